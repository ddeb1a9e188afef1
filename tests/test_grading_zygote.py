"""Pooled grading (grading/pool.py, grading/zygote.py): the same verdicts as a fresh sandbox per patch, and
nothing one test run leaves (processes, files, IPC, ports, environment, modules) reaches the next.

Real sandboxes, git and pytest. The pool needs a root driver and bubblewrap; elsewhere grading falls back
to a fresh sandbox per patch, and the tests that need the pool say so when they skip."""

from __future__ import annotations

import asyncio
import os
import re
from pathlib import Path

import pytest
from backends import bwrap_cfg

from legorl.config import SandboxConfig
from legorl.grading import grade
from legorl.grading.canaries import PATCH_CANARIES, CanaryContext
from legorl.grading.pool import SWITCH, current_pool, fallback_reason, pytest_args
from legorl.records import GraderReport, Outcome
from legorl.tasks import FAMILIES, generate_tasks, prepare_repo
from legorl.tasks.builtin import unified_diff

TASK = generate_tasks(["wrong_operator"], 1, seed=21, split="train")[0]
MODULE = next(p for p in TASK.files if p.startswith("pkg_") and not p.endswith("__init__.py"))


def pooled_cfg() -> SandboxConfig:
    cfg = bwrap_cfg()
    if why := fallback_reason(TASK, cfg, keep=False):
        pytest.skip(f"grading does not use the pool here: {why}")
    return cfg


def append(code: str, base: str = "") -> str:
    """A diff appending ``code`` to the task's module (after the gold fix when ``base`` is the gold patch)."""
    old = TASK.files[MODULE]
    fixed = old
    if base:
        import subprocess
        import tempfile

        with tempfile.TemporaryDirectory() as d:
            prepare_repo(TASK, Path(d))
            subprocess.run(["git", "apply", "-"], input=base.encode(), cwd=d, check=True)
            fixed = (Path(d) / MODULE).read_text()
    return unified_diff(MODULE, old, fixed + code)


def essentials(rep: GraderReport) -> tuple:
    reason = re.sub(r"'\d{6,}'", "'<id>'", rep.reason)  # an unnamed plugin's name is its id()
    return (rep.outcome, rep.resolved, reason, rep.tests, rep.applied_paths, rep.dropped_paths,
            rep.collected, rep.exit_code)  # fmt: skip


def test_pooled_verdicts_equal_fresh_sandbox_verdicts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Gold patches resolve, empty ones fail and every canary is caught, with the same report either way."""
    cfg = pooled_cfg()
    tasks = generate_tasks(None, len(FAMILIES), seed=7, split="train")
    ctx = CanaryContext(TASK, tmp_path / "pristine")
    prepare_repo(TASK, ctx.repo)
    cases = [(t, t.patch) for t in tasks] + [(t, "") for t in tasks[:3]]
    cases += [(TASK, make(ctx)) for make in PATCH_CANARIES.values()]
    cases += [(TASK, append("import os as _o\n_o._exit(0)\n")), (TASK, append("import os as _o\n_o.kill(_o.getpid(), 9)\n"))]

    async def all_of(pooled: bool):
        monkeypatch.setenv(SWITCH, "1" if pooled else "0")
        sem = asyncio.Semaphore(3)

        async def one(task, diff):
            async with sem:
                return await grade(task, diff, work_dir=tmp_path / "w", sandbox=cfg)

        reports = await asyncio.gather(*(one(t, d) for t, d in cases))
        return reports, current_pool().started

    fresh, started_fresh = asyncio.run(all_of(False))
    pooled, started_pooled = asyncio.run(all_of(True))
    assert started_fresh == 0 and 1 <= started_pooled <= 3  # one pooled sandbox per concurrent grading
    for (task, diff), a, b in zip(cases, fresh, pooled, strict=True):
        assert essentials(a) == essentials(b), (task.family, diff[:300], a.reason, b.reason, b.log_tail[-800:])
    n = len(tasks)
    assert all(r.resolved for r in pooled[:n]), [r.reason for r in pooled[:n]]
    assert all(r.outcome == Outcome.UNRESOLVED for r in pooled[n:]), [r.reason for r in pooled[n:]]


LEAVE_BEHIND = r"""
import ctypes as _c, os as _o, socket as _s, subprocess as _p, sys as _y
_o.system("setsid sleep 1000 >/dev/null 2>&1 &")
_p.Popen([_y.executable, "-c", "import socket,time; s=socket.socket(); s.bind(('127.0.0.1', 45678)); s.listen(); time.sleep(1000)"],
         start_new_session=True)
for _f in ("/tmp/leak", "/dev/shm/leak", _o.path.expanduser("~/.leak"), "/workspace/LEAK"):
    open(_f, "w").write("x")
_o.environ["LEAK"] = "1"
_y.modules["leakmod"] = _y
_c.CDLL(None).shmget(0x4C45414B, 4096, 0o1000 | 0o666)
"""

CHECK_CLEAN = r"""
import ctypes as _c, os as _o, socket as _s, sys as _y
def _leaks():
    found = [f for f in ("/tmp/leak", "/dev/shm/leak", _o.path.expanduser("~/.leak"), "/workspace/LEAK") if _o.path.exists(f)]
    found += [k for k in ("LEAK",) if k in _o.environ] + [m for m in ("leakmod",) if m in _y.modules]
    if _c.CDLL(None).shmget(0x4C45414B, 0, 0) != -1:
        found.append("shm segment")
    me = int(_o.readlink("/proc/self"))
    for pid in _o.listdir("/proc"):
        if not pid.isdigit() or int(pid) == me:
            continue
        try:
            if b"sleep" in open(f"/proc/{pid}/cmdline", "rb").read() or b"45678" in open(f"/proc/{pid}/cmdline", "rb").read():
                found.append(f"process {pid} left running")
        except OSError:
            pass
        try:  # no process outside this run may be open to it (ptrace-level access)
            _o.close(_o.open(f"/proc/{pid}/mem", _o.O_RDONLY))
            found.append(f"/proc/{pid}/mem opens")
        except OSError:
            pass
    try:
        _t = _s.socket(); _t.bind(("127.0.0.1", 45678)); _t.close()
    except OSError as e:
        found.append(f"port 45678 taken: {e}")
    for ctl in ("/run/leg" "orl/control.sock", "/run/leg" "orl-verifier/z/zygote.sock"):  # (the scan refuses the word)
        if _o.path.exists(ctl):
            found.append(f"{ctl} reachable")
    if [n for n in _o.listdir("/workspace") if _o.path.isdir(f"/workspace/{n}/.git")]:
        found.append("another patch's copy is visible")
    _r, _w = _o.pipe()
    if _o.fork() == 0:  # in a user and mount namespace of its own, the run's covers must not come off
        _l = _c.CDLL(None, use_errno=True)
        _ok = _l.unshare(0x10000000 | 0x20000) == 0
        _lifted = [p for p in ("/run/leg" "orl", "/workspace", "/tmp") if _ok and _l.umount2(p.encode(), 2) == 0]
        _o.write(_w, repr(_lifted if _ok else ["unshare failed"]).encode())
        _o._exit(0)
    _o.close(_w)
    _got = _o.read(_r, 4096).decode()
    if _got != "[]":
        found.append(f"mounts lifted from a nested namespace: {_got}")
    caps = [l for l in open("/proc/self/status") if l.startswith(("CapEff", "CapPrm"))]
    if any(int(l.split()[1], 16) for l in caps):
        found.append(f"capabilities held: {caps}")
    return found
if _leaks():
    raise RuntimeError(f"LEAKED: {_leaks()}")
"""


def test_nothing_a_run_leaves_reaches_the_next_patch(tmp_path: Path) -> None:
    """Patch A leaves processes, files in /tmp, /dev/shm and HOME, a SysV segment, a listening port, an
    environment variable and a module behind; patch B (the fix, plus a check that raises at import if it
    finds any of that, or can reach a process or control socket outside its run) resolves on the same
    pooled sandbox."""
    cfg = pooled_cfg()

    async def main():
        a = await grade(TASK, append(LEAVE_BEHIND), work_dir=tmp_path, sandbox=cfg)
        b = await grade(TASK, append(CHECK_CLEAN, base=TASK.patch), work_dir=tmp_path, sandbox=cfg)
        pool = current_pool()
        return a, b, pool.started, [m.uses for m in pool.live.values()]

    a, b, started, uses = asyncio.run(main())
    assert a.outcome == Outcome.UNRESOLVED and a.collected, (a.reason, a.log_tail[-800:])
    assert started == 1 and uses == [2], (started, uses, b.reason)  # the same sandbox and zygote graded both
    assert b.resolved, (b.reason, b.log_tail[-1500:])


def test_a_timed_out_run_ends_whole_and_the_sandbox_grades_on(tmp_path: Path) -> None:
    cfg = pooled_cfg()
    spin = append("import os as _o\n_o.system('setsid sleep 1000 &')\nwhile True:\n    pass\n")

    async def main():
        hung = await grade(TASK, spin, work_dir=tmp_path, sandbox=cfg, timeout=3)
        gold = await grade(TASK, TASK.patch, work_dir=tmp_path, sandbox=cfg)
        return hung, gold, current_pool().started

    hung, gold, started = asyncio.run(main())
    assert hung.outcome == Outcome.UNRESOLVED and hung.reason == "tests timed out", hung.reason
    assert gold.resolved and started == 1, (gold.reason, started)


def test_which_gradings_take_the_pool() -> None:
    assert pytest_args("python -m pytest -q") == ["-q"]
    assert pytest_args("python -m pytest -q -x tests") == ["-q", "-x", "tests"]
    assert pytest_args("python -m pytest -q -o addopts= -o pythonpath=src") == ["-q", "-o", "addopts=", "-o",
                                                                               "pythonpath=src"]  # fmt: skip
    for command in ("pytest -q", "python3 -m pytest", "python -m pytest; rm -rf /", "FOO=1 python -m pytest",
                    "python -m pytest $ARGS", "bash tests/test.sh", "python -m unittest"):
        assert pytest_args(command) is None, command
    cfg = SandboxConfig()
    root = os.geteuid() == 0
    assert (fallback_reason(TASK, cfg, keep=False) is None) == root
    assert "keep" in (fallback_reason(TASK, cfg, keep=True) or "")
    assert "docker" in (fallback_reason(TASK, SandboxConfig(kind="docker"), keep=False) or "")
    for update in ({"test_command": "python -m unittest"}, {"setup": "pip install -e ."}, {"tests_dir": "/tests"},
                   {"environment": "/opt/env"}):
        assert fallback_reason(TASK.model_copy(update=update), cfg, keep=False), update
    os.environ[SWITCH] = "0"
    try:
        assert SWITCH in (fallback_reason(TASK, cfg, keep=False) or "")
    finally:
        del os.environ[SWITCH]


def test_a_runs_fresh_tmp_keeps_the_sandboxs_binds_below_it():
    # A checkout under /tmp puts the sandbox's interpreter (its venv, bound read-only) below /tmp: a
    # run's fresh /tmp must bind it back (outermost mounts only, read-only kept), or pytest is gone.
    from legorl.grading.zygote import _mounts_below

    mountinfo = """
20 1 0:5 / / rw,nosuid - tmpfs tmpfs rw
21 20 0:6 / /tmp rw,nosuid,nodev - tmpfs tmpfs rw
22 21 8:1 /tmp/ci/.venv /tmp/ci/.venv ro,nosuid,nodev - ext4 /dev/sda1 rw
23 22 8:1 /x /tmp/ci/.venv/lib/inner ro,nosuid - ext4 /dev/sda1 rw
24 21 8:1 /y /tmp/my\\040dir rw,nosuid - ext4 /dev/sda1 rw
25 20 0:7 / /dev/shm rw - tmpfs tmpfs rw
26 20 8:1 /usr /usr ro - ext4 /dev/sda1 rw
27 20 8:1 /tmpfoo /tmpfoo ro - ext4 /dev/sda1 rw
"""
    assert _mounts_below(("/tmp", "/dev/shm"), mountinfo) == [("/tmp/my dir", False), ("/tmp/ci/.venv", True)]


def test_the_zygotes_warm_up_session_leaves_its_state_as_it_was(tmp_path: Path) -> None:
    # warm_up runs a whole pytest session inside the zygote before it forks any run: what it imports
    # lazily may stay (a fresh run imports it too), but nothing of its own test file, and no change to
    # the paths, import hooks, warning filters, cwd or stdio a run inherits. In a subprocess: a pytest
    # session nested in this one would share its state.
    import json
    import subprocess
    import sys

    import legorl
    from legorl.grading.pool import ZYGOTE_SOURCE

    # The project's own modules by where they are (the package's source dir, and the warm-up's throwaway dir
    # under TMPDIR), never by a name: a checkout in a directory named `legorl` holds its .venv too.
    own_dirs = (str(Path(legorl.__file__).resolve().parent) + os.sep, str(tmp_path.resolve()) + os.sep)
    probe = f"""
import json, os, sys, warnings
own_dirs = {own_dirs!r}
z = {{"__name__": "legorl_zygote"}}
exec(compile(open({str(ZYGOTE_SOURCE)!r}).read(), "<legorl-zygote>", "exec"), z)
state = lambda: [list(sys.path), [repr(h) for h in sys.meta_path], [repr(f) for f in warnings.filters], os.getcwd(),
                 hasattr(sys, "last_value")]
before, modules = state(), set(sys.modules)
print("stdout still here", flush=True)
z["warm_up"]()
print("stdout still here", flush=True)
new = sorted(set(sys.modules) - modules)
print(json.dumps({{"same": state() == before, "new": new,
                  "own": [m for m in new if "warm_up" in m
                          or os.path.realpath(getattr(sys.modules[m], "__file__", "") or "/").startswith(own_dirs)],
                  "tmp": [p for p in os.listdir({str(tmp_path)!r})]}}))
"""
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=120, check=True).stdout.splitlines()  # fmt: skip
    assert out[:2] == ["stdout still here"] * 2, out  # the session's output went nowhere, stdio came back
    result = json.loads(out[2])
    assert result["same"], result
    assert result["own"] == [], result  # its test module is gone (a run may name its own module alike)
    assert result["tmp"] == [], result  # its throwaway dir too
    assert result["new"], result  # it did run: what it imported lazily stays


def test_a_run_takes_the_prebuilt_config_only_when_it_blocks_the_same_plugins(tmp_path: Path) -> None:
    # prebuild_config builds pytest's Config with the default plugins before any run; a run's session takes
    # it (once, with its own arguments and directory) only when its `-p no:` arguments are the ones it was
    # built with: a task's command line that blocks another plugin gets a Config built for it, as always.
    import subprocess
    import sys

    from legorl.grading.pool import ZYGOTE_SOURCE
    from legorl.grading.zygote import _exclusions

    assert _exclusions(["-q", "-p", "no:cacheprovider", "-pno:doctest", "-p", "myplugin", "-p"]) == {
        "no:cacheprovider", "no:doctest"}  # fmt: skip
    probe = f"""
import _pytest.config as pc
z = {{"__name__": "legorl_zygote"}}
exec(compile(open({str(ZYGOTE_SOURCE)!r}).read(), "<legorl-zygote>", "exec"), z)
z["prebuild_config"](); built = z["PREBUILT"]["config"]; z["_use_prebuilt_config"]()
run = pc.get_config(["-q", "-p", "no:cacheprovider", "tests/test_x.py"])
again = pc.get_config(["-p", "no:cacheprovider"])
print(run is built, run.invocation_params.args == ("-q", "-p", "no:cacheprovider", "tests/test_x.py"),
      str(run.invocation_params.dir), again is not built)
z["prebuild_config"](); built = z["PREBUILT"]["config"]; z["_use_prebuilt_config"]()
other = pc.get_config(["-p", "no:cacheprovider", "-p", "no:doctest"])
print(other is not built, other.pluginmanager.is_blocked("doctest"), built.pluginmanager.get_plugin("doctest") is not None)
"""
    out = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                         check=True).stdout.split()  # fmt: skip
    assert out == ["True", "True", str(tmp_path), "True", "True", "True", "True"], out
