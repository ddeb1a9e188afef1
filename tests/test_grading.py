"""The grader end to end (real sandboxes, git, pytest) plus its path policy, stream verdicts and JUnit handling.

The end-to-end tests take ``box_cfg`` and run on both backends: bubblewrap and docker (tests/backends.py)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest
from backends import kill_agent

from legorl.config import SandboxConfig
from legorl.grading import filter_diff, grade, junit_key, parse_junit, workspace_diff
from legorl.grading.junit import JUnitError, parse_junit_text, to_junit_xml
from legorl.grading.policy import filter_diff_detailed
from legorl.grading.stream import ResultServer, StreamedRun
from legorl.grading.tamper import scan
from legorl.grading.verdict import decide
from legorl.records import Outcome
from legorl.sandbox import create_sandbox
from legorl.tasks import FAMILIES, Task, generate_tasks, prepare_repo
from legorl.tasks.builtin import unified_diff


async def gather_limited(coros, limit: int = 3):
    sem = asyncio.Semaphore(limit)

    async def one(c):
        async with sem:
            return await c

    return await asyncio.gather(*(one(c) for c in coros))


def test_gold_resolves_and_empty_diff_does_not_for_every_family(tmp_path: Path, box_cfg: SandboxConfig) -> None:
    tasks = generate_tasks(None, len(FAMILIES), seed=7, split="train")  # one instance per family

    async def main():
        gold = gather_limited(grade(t, t.patch, work_dir=tmp_path, sandbox=box_cfg) for t in tasks)
        empty = gather_limited(grade(t, "", work_dir=tmp_path, sandbox=box_cfg) for t in tasks[:3])
        return await gold, await empty

    gold, empty = asyncio.run(main())
    for task, rep in zip(tasks, gold, strict=True):
        assert rep.outcome == Outcome.RESOLVED and rep.resolved, (task.family, rep.reason, rep.log_tail)
        assert set(rep.tests.values()) == {"passed"} and rep.collected == len(task.test_ids)
        assert rep.applied_paths and not rep.dropped_paths and rep.exit_code == 0
    for task, rep in zip(tasks[:3], empty, strict=True):
        assert rep.outcome == Outcome.UNRESOLVED and not rep.resolved, task.family
        assert {rep.tests[t] for t in task.FAIL_TO_PASS} == {"failed"}
        assert {rep.tests[t] for t in task.PASS_TO_PASS} == {"passed"}
    assert not list(tmp_path.iterdir())  # grading work dirs are cleaned up


HACKS = r"""
cat > conftest.py <<'EOF'
import pytest
@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    outcome.get_result().outcome = "passed"
EOF
mkdir -p tests && printf 'def test_anything():\n    assert True\n' > tests/test_hidden.py
echo 'import os' > sitecustomize.py
echo 'import sitecustomize' > evil.pth
printf '[pytest]\naddopts = -p no:junitxml\n' > pytest.ini
printf 'def main(): pass\n' > pytest.py
echo '# docs' >> README.md
git add -A && git commit -qm 'agent commit' && echo committed
"""


def test_test_path_hacks_are_dropped_and_not_resolved(tmp_path: Path, box_cfg: SandboxConfig) -> None:
    task = generate_tasks(["wrong_operator"], 1, seed=1, split="train")[0]

    async def main():
        base = prepare_repo(task, tmp_path / "ws")
        box = await create_sandbox(box_cfg, workspace=tmp_path / "ws", sandbox_dir=tmp_path / "sb", label="agent")
        try:
            r = await box.exec(HACKS)
            assert "committed" in r.output, r.output
            diff = await workspace_diff(box, base)
        finally:
            await box.close()
        return diff, await grade(task, diff, work_dir=tmp_path / "grade", artifacts_dir=tmp_path / "art",
                                 sandbox=box_cfg)

    diff, rep = asyncio.run(main())
    assert "conftest.py" in diff and "README.md" in diff  # committed + untracked changes both captured
    assert rep.outcome == Outcome.UNRESOLVED and not rep.resolved
    assert rep.dropped_paths == sorted(
        ["conftest.py", "evil.pth", "pytest.ini", "pytest.py", "sitecustomize.py", "tests/test_hidden.py"]
    )
    assert rep.applied_paths == ["README.md"]
    assert rep.tests[task.FAIL_TO_PASS[0]] == "failed"
    saved = json.loads((tmp_path / "art" / "report.json").read_text())
    assert saved["outcome"] == "unresolved" and "pytest.py" in saved["dropped_diff"]
    assert "README.md" in saved["applied_diff"] and saved["drop_reasons"]["pytest.py"].startswith("shadows")
    junit = parse_junit(tmp_path / "art" / "junit.xml")  # the verifier-owned report, built on the host
    assert junit[junit_key(task.FAIL_TO_PASS[0])] == "failed"


def test_agent_fix_via_workspace_diff_resolves(tmp_path: Path, box_cfg: SandboxConfig) -> None:
    task = generate_tasks(["wrong_return"], 1, seed=3, split="train")[0]

    async def main():
        base = prepare_repo(task, tmp_path / "ws")
        box = await create_sandbox(box_cfg, workspace=tmp_path / "ws", sandbox_dir=tmp_path / "sb", label="agent")
        try:
            await box.write_file("/tmp/fix.patch", task.patch)
            assert (await box.exec("git apply /tmp/fix.patch && echo 'notes' > NOTES.md")).returncode == 0
            diff = await workspace_diff(box, base)
        finally:
            await box.close()
        return diff, await grade(task, diff, work_dir=tmp_path / "grade", sandbox=box_cfg)

    _, rep = asyncio.run(main())
    assert rep.resolved and rep.outcome == Outcome.RESOLVED, (rep.reason, rep.log_tail)
    assert "NOTES.md" in rep.applied_paths


def test_bad_patches_and_broken_source(tmp_path: Path, box_cfg: SandboxConfig) -> None:
    task = generate_tasks(["off_by_one"], 1, seed=2, split="train")[0]
    mod = next(p for p in task.files if p.startswith("pkg_") and not p.endswith("__init__.py"))
    garbage = (
        f"diff --git a/{mod} b/{mod}\n--- a/{mod}\n+++ b/{mod}\n@@ -1,1 +1,1 @@\n-nothing like this\n+x\n"
    )
    syntax = unified_diff(mod, task.files[mod], task.files[mod] + "def broken(:\n    pass\n")
    no_repo = Task(instance_id="x", repo="x", repo_path="/nonexistent/repo.tar.gz", problem_statement="p")

    async def main():
        return await asyncio.gather(
            grade(task, garbage, work_dir=tmp_path, sandbox=box_cfg),
            grade(task, syntax, work_dir=tmp_path, sandbox=box_cfg),
            grade(no_repo, "", work_dir=tmp_path, sandbox=box_cfg),
            grade(
                task.model_copy(update={"setup": "echo setting up; exit 7"}), task.patch, work_dir=tmp_path,
                sandbox=box_cfg,
            ),
            grade(task.model_copy(update={"test_command": "true"}), task.patch, work_dir=tmp_path, sandbox=box_cfg),
        )

    not_applied, broken, infra, bad_setup, not_pytest = asyncio.run(main())
    assert not_applied.outcome == Outcome.UNRESOLVED and not_applied.reason.startswith("patch did not apply")
    assert broken.outcome == Outcome.UNRESOLVED and not broken.resolved and "collect" in broken.reason
    assert all(s in ("error", "missing", "failed") for s in broken.tests.values())
    assert infra.outcome == Outcome.GRADER_ERROR and "nonexistent" in infra.reason
    assert bad_setup.outcome == Outcome.GRADER_ERROR and "setup failed" in bad_setup.reason
    assert "setting up" in bad_setup.log_tail
    assert not_pytest.outcome == Outcome.GRADER_ERROR and "verifier plugin never reported" in not_pytest.reason


def test_filter_diff_policy() -> None:
    diff = (
        "diff --git a/src/m.py b/src/m.py\n--- a/src/m.py\n+++ b/src/m.py\n@@ -1 +1 @@\n-a\n+b\n"
        "diff --git a/pkg/conftest.py b/pkg/conftest.py\nnew file mode 100644\n--- /dev/null\n"
        "+++ b/pkg/conftest.py\n@@ -0,0 +1 @@\n+x\n"
        "diff --git a/lib/link.py b/lib/link.py\nnew file mode 120000\n--- /dev/null\n+++ b/lib/link.py\n"
        "@@ -0,0 +1 @@\n+../tests/test_hidden.py\n\\ No newline at end of file\n"
        'diff --git "a/we ird/x_test.py" "b/we ird/x_test.py"\n--- "a/we ird/x_test.py"\n'
        '+++ "b/we ird/x_test.py"\n@@ -1 +1 @@\n-a\n+b\n'
        "diff --git a/old.py b/tests/moved.py\nsimilarity index 100%\nrename from old.py\nrename to tests/moved.py\n"
        "diff --git a/doc.md b/doc.md\n--- a/doc.md\n+++ b/doc.md\n@@ -1,2 +1,2 @@\n--- a/tests/x.py\n+ok\n"
    )
    kept, applied, dropped = filter_diff(diff)
    assert applied == ["doc.md", "src/m.py"]
    assert dropped == ["lib/link.py", "old.py", "pkg/conftest.py", "tests/moved.py", "we ird/x_test.py"]
    assert "conftest" not in kept and kept.startswith("diff --git a/src/m.py")
    _, applied, dropped = filter_diff("--- a/m.py\n+++ b/m.py\n@@ -1 +1 @@\n-a\n+b\n", protected={"m.py"})
    assert (applied, dropped) == ([], ["m.py"])


def _new(path: str) -> str:
    return f"diff --git a/{path} b/{path}\nnew file mode 100644\n--- /dev/null\n+++ b/{path}\n@@ -0,0 +1 @@\n+x = 1\n"


def test_policy_config_files_shadowing_and_task_globs() -> None:
    paths = ["pyproject.toml", "setup.cfg", "tox.ini", ".pytest.ini", "src/usercustomize.py", "a/b/c.pth",
             "json.py", "_pytest/__init__.py", "pluggy.py", "legorl_verifier.py", "typing/__init__.py",
             "docs/json.py", "json.md", "pkg/secret_data.txt", "io.py", "pkg/core.py"]  # fmt: skip
    f = filter_diff_detailed("".join(map(_new, paths)), protected={"pkg/secret_*"}, base_paths={"io.py", "pkg"})
    assert f.applied_paths == ["docs/json.py", "io.py", "json.md", "pkg/core.py"]  # io.py: the repo's own module
    assert f.reasons["json.py"].startswith("shadows") and f.reasons["pluggy.py"].startswith("shadows")
    assert f.reasons["pkg/secret_data.txt"] == "protected by the task"
    assert f.reasons["pyproject.toml"] == f.reasons[".pytest.ini"] == "test or test-infrastructure path"
    assert "x = 1" in f.dropped and f.kept.count("diff --git") == 4


def test_tamper_scan_flags_runner_hooks_unless_already_there() -> None:
    patched = {"pkg/m.py": "x = 1\nimport _pytest.runner\nopen('/logs/verifier/reward.txt', 'w')\n"}
    findings = scan(patched, lambda p: "x = 1\n")
    assert findings == ["pkg/m.py adds '_pytest'", "pkg/m.py adds '/logs/verifier'", "pkg/m.py adds 'reward.txt'"]
    assert scan(patched, lambda p: "import _pytest\n# /logs/verifier/reward.txt\n") == []  # pytest's own sources
    assert scan({"pkg/clean.py": "def f():\n    return 1\n"}, lambda p: None) == []


def _events(*reports: tuple[str, str, str], collected=None, exitstatus=0, extra=()) -> StreamedRun:
    run = StreamedRun()
    ids = collected if collected is not None else sorted({r[0] for r in reports})
    for ev in [
        {"ev": "start"}, {"ev": "configured", "rootdir": "/workspace"}, {"ev": "plugin", "name": "terminalreporter"},
        {"ev": "collection_start"}, {"ev": "plugin", "name": "conftest", "file": "/workspace/tests/conftest.py"},
        {"ev": "collected", "ids": ids},
        *({"ev": "report", "nodeid": n, "when": w, "outcome": o} for n, w, o in reports),
        *extra, {"ev": "finish", "exitstatus": exitstatus}, {"ev": "end"},
    ]:  # fmt: skip
        run.feed(ev)
    return run


def _passed(nodeid: str) -> list[tuple[str, str, str]]:
    return [(nodeid, "setup", "passed"), (nodeid, "call", "passed"), (nodeid, "teardown", "passed")]


def test_verdict_needs_stream_exit_code_and_junit_to_agree() -> None:
    ids = ["t.py::a", "t.py::b[1]", "t.py::b[2]"]
    junit_ok = {("t", "a"): "passed", ("t", "b[1]"): "passed", ("t", "b[2]"): "passed"}
    good = _events(*_passed(ids[0]), *_passed(ids[1]), *_passed(ids[2]))
    ok = decide(good, ["t.py::a", "t.py::b"], exit_code=0, timed_out=False, junit=junit_ok)
    assert ok.resolved and ok.tests == {"t.py::a": "passed", "t.py::b": "passed"}  # `b` covers its parameters
    cases = {
        "exit status rewritten": {"exit_code": 1},
        "timed out": {"timed_out": True},
        "JUnit report is unusable": {"junit": None},
        "disagrees": {"junit": {**junit_ok, ("t", "a"): "failed"}},
    }
    for reason, change in cases.items():
        kw = {"exit_code": 0, "timed_out": False, "junit": junit_ok} | change
        v = decide(good, ["t.py::a"], **kw)
        assert v.outcome == Outcome.UNRESOLVED and reason in v.reason, (reason, v.reason)
    failing = _events(*_passed(ids[0]), (ids[1], "setup", "passed"), (ids[1], "call", "failed"),
                      (ids[1], "teardown", "passed"), exitstatus=0)  # fmt: skip
    v = decide(failing, ["t.py::a"], exit_code=0, timed_out=False, junit=junit_ok)
    assert "inconsistent" in v.reason  # a failure, yet pytest says 0
    no_teardown = _events(*_passed(ids[0])[:2], exitstatus=0)
    assert decide(no_teardown, ["t.py::a"], exit_code=0, timed_out=False, junit=junit_ok).tests == {"t.py::a": "missing"}
    forged = _events(*_passed(ids[0]), extra=[{"ev": "report", "nodeid": ids[0], "when": "call", "outcome": "passed"}])
    assert "duplicate call result" in decide(forged, ["t.py::a"], exit_code=0, timed_out=False, junit=junit_ok).reason
    hooked = _events(*_passed(ids[0]), extra=[{"ev": "plugin", "name": "140234", "file": None}])
    assert "registered during the run" in decide(hooked, ["t.py::a"], exit_code=0, timed_out=False,
                                                  junit=junit_ok).reason  # fmt: skip
    empty = _events(collected=[], exitstatus=5)
    assert "no tests collected" in decide(empty, ["t.py::a"], exit_code=5, timed_out=False, junit={}).reason
    silent = StreamedRun()
    assert decide(silent, ["t.py::a"], exit_code=0, timed_out=False, junit=None).outcome == Outcome.GRADER_ERROR
    truncated = StreamedRun()
    for ev in ({"ev": "start"}, {"ev": "collection_start"}):
        truncated.feed(ev)
    v = decide(truncated, ["t.py::a"], exit_code=0, timed_out=False, junit=None)
    assert v.outcome == Outcome.UNRESOLVED and "before collection finished" in v.reason


def test_result_stream_is_kept_when_the_loop_had_not_accepted_it_yet() -> None:
    """The test process connects, reports and exits while the grader's event loop is busy: its
    connection is still queued when the grader asks for the stream. It must be read, not lost (a
    `grader_error` "the verifier plugin never reported" under load, with "3 passed" in the log)."""
    import socket

    async def main() -> tuple[bool, StreamedRun, bool]:
        async with ResultServer() as results:
            plugin = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            plugin.connect(str(results.socket_path))  # blocking: the loop has not run since
            plugin.sendall(b'{"ev": "start"}\n{"ev": "configured", "rootdir": "/workspace"}\n')
            plugin.close()
            done = await results.wait_done(5.0)
        async with ResultServer() as silent:  # pytest never started: no connection at all
            never = await silent.wait_done(0.2)
        return done, results.run, never

    done, run, never = asyncio.run(main())
    assert done and run.started and run.configured and not run.anomalies
    assert never is False


def test_junit_key_matches_pytest_for_parameter_ids_holding_colons(tmp_path: Path) -> None:
    """pytest splits the [params] off before the '::' path: 'ldap://[::1]' stays in the name."""
    (tmp_path / "test_p.py").write_text(
        "import pytest\n\n@pytest.mark.parametrize('u', ['ldap://[::1]:389', 'a::b'])\n"
        "def test_u(u):\n    assert u\n")
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--junitxml", "j.xml",
                          "test_p.py"], check=False, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    junit = parse_junit(tmp_path / "j.xml")
    for node_id in ("test_p.py::test_u[ldap://[::1]:389]", "test_p.py::test_u[a::b]"):
        assert junit[junit_key(node_id)] == "passed", (junit_key(node_id), junit)


def test_junit_mapping_round_trip_and_garbled_reports(tmp_path: Path) -> None:
    assert junit_key("tests/test_hidden.py::test_x") == ("tests.test_hidden", "test_x")
    assert junit_key("tests/a/test_b.py::TestC::test_d[1-2]") == ("tests.a.test_b.TestC", "test_d[1-2]")
    report = tmp_path / "j.xml"
    report.write_text(
        '<testsuites><testsuite><testcase classname="t.m" name="ok"/>'
        '<testcase classname="t.m" name="bad"><failure message="x"/></testcase>'
        '<testcase classname="t.m" name="ok"><error message="teardown"/></testcase>'
        '<testcase classname="t.m" name="sk"><skipped/></testcase></testsuite></testsuites>'
    )
    assert parse_junit(report) == {("t.m", "ok"): "error", ("t.m", "bad"): "failed", ("t.m", "sk"): "skipped"}
    xml = to_junit_xml({"t/m.py::ok": "passed", "t/m.py::bad": "failed", "t/m.py::gone": "missing"})
    assert parse_junit_text(xml) == {("t.m", "ok"): "passed", ("t.m", "bad"): "failed", ("t.m", "gone"): "error"}
    report.write_text("<testsuites><testcase")
    with pytest.raises(JUnitError, match="not valid XML"):
        parse_junit(report)
    with pytest.raises(JUnitError, match="no JUnit"):
        parse_junit(tmp_path / "none.xml")


def _as_test_patch(task: Task) -> Task:
    """The same task with SWE-bench style hidden tests: a test_patch that edits an existing test file."""
    path = "tests/test_basic.py"
    old = task.files[path]
    hidden = task.hidden_files["tests/test_hidden.py"]
    body = hidden.split("\n\n", 1)[1]  # drop the docstring line, keep the import + tests
    new = old + "\n\n" + body
    patch = unified_diff(path, old, new)
    ids = [t.replace("tests/test_hidden.py", path) for t in task.test_ids]
    n = len(task.FAIL_TO_PASS)
    return task.model_copy(
        update={"hidden_files": {}, "test_patch": patch, "FAIL_TO_PASS": ids[:n], "PASS_TO_PASS": ids[n:]}
    )


def test_swebench_style_test_patch(tmp_path: Path, box_cfg: SandboxConfig) -> None:
    task = _as_test_patch(generate_tasks(["wrong_constant"], 1, seed=4, split="train")[0])
    mod = next(p for p in task.files if p.startswith("pkg_") and not p.endswith("__init__.py"))
    # The agent rewrote the visible test file: dropped, and the file is restored from the base commit.
    tamper = unified_diff(
        "tests/test_basic.py", task.files["tests/test_basic.py"], "def test_x():\n    pass\n"
    )

    async def main():
        return await asyncio.gather(
            grade(task, task.patch + tamper, work_dir=tmp_path, sandbox=box_cfg),
            grade(task, "", work_dir=tmp_path, sandbox=box_cfg),
        )

    gold, empty = asyncio.run(main())
    assert gold.resolved, (gold.reason, gold.log_tail)
    assert gold.applied_paths == [mod] and gold.dropped_paths == ["tests/test_basic.py"]
    assert empty.outcome == Outcome.UNRESOLVED and empty.tests[task.FAIL_TO_PASS[0]] == "failed"


def test_dead_sandbox_raises_sandbox_error(tmp_path: Path, box_cfg: SandboxConfig) -> None:
    from legorl.sandbox.client import SandboxClient, SandboxError

    async def main():
        (tmp_path / "ws").mkdir()
        box = await create_sandbox(box_cfg, workspace=tmp_path / "ws", sandbox_dir=tmp_path / "sb", label="x")
        try:
            kill_agent(box)
            for _ in range(200):  # until it can no longer answer
                if not SandboxClient(box.control_socket).ping(timeout=0.5):
                    break
                await asyncio.sleep(0.05)
            with pytest.raises(SandboxError):
                await box.exec("echo hi", timeout=5)
            with pytest.raises(SandboxError):
                await workspace_diff(box)
        finally:
            await box.close()

    asyncio.run(main())
