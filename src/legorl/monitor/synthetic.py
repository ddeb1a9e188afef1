"""A synthetic run store with the real schema, for the dashboard's benchmark and tests.

Rows are bulk-inserted with executemany (100k rollouts and 1M calls in well under a
minute); each agent turn is a real-looking tool call (bash commands in mini-swe-agent
style, Read/Edit/Bash in Claude Code style, shell/apply_patch in Codex style) with
small token arrays, so every page, including behaviour analytics, has data.
"""

from __future__ import annotations

import json
import random
import sqlite3
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from legorl.records import Outcome
from legorl.store import Store

OUTCOME_WEIGHTS = {"resolved": 0.30, "unresolved": 0.45, "max_turns": 0.10, "agent_timeout": 0.04,
                   "agent_crash": 0.02, "no_model_calls": 0.01, "context_overflow": 0.02, "sandbox_error": 0.02,
                   "engine_error": 0.01, "grader_error": 0.02, "invalid_capture": 0.01}
TRAINED = {"resolved", "unresolved", "max_turns"}
SCRIPT = ["grep -rn 'def target' .", "cat pkg/mod.py", "sed -i 's/a + b/a - b/' pkg/mod.py", "cat pkg/mod.py",
          "python -m pytest -q", "ls tests", "nl -ba pkg/mod.py", "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"]
HARNESSES = ("mini-swe-agent", "claude-code", "codex")


@dataclass
class SyntheticSpec:
    steps: int = 20
    rollouts_per_step: int = 16
    group_size: int = 4
    calls_per_rollout: int = 6  # mean; each rollout has 1..2*mean-1
    tokens_per_call: int = 8  # prompt and completion token arrays are this long
    tasks: int = 200
    eval_every: int = 5  # eval rollouts (split eval-heldout) every N steps; 0 = none
    full_history: bool = True  # requests carry the whole conversation (else only the last turn)
    seed: int = 0


def _tool_call(harness: str, command: str, k: int) -> dict[str, Any]:
    cid = f"call_{k}"
    if harness == "claude-code":
        if command.startswith("cat "):
            return {"id": cid, "name": "Read", "arguments": json.dumps({"file_path": command[4:]})}
        if command.startswith("sed -i"):
            return {"id": cid, "name": "Edit", "arguments": json.dumps(
                {"file_path": "pkg/mod.py", "old_string": "a + b", "new_string": "a - b"})}
        return {"id": cid, "name": "Bash", "arguments": json.dumps({"command": command})}
    if harness == "codex":
        if command.startswith("sed -i"):
            patch = "*** Begin Patch\n*** Update File: pkg/mod.py\n@@\n-a + b\n+a - b\n*** End Patch"
            return {"id": cid, "name": "apply_patch", "arguments": json.dumps({"input": patch})}
        return {"id": cid, "name": "shell", "arguments": json.dumps({"command": ["bash", "-lc", command]})}
    return {"id": cid, "name": "bash", "arguments": json.dumps({"command": command})}


def _rows(spec: SyntheticSpec) -> Iterator[tuple[str, tuple[Any, ...], list[tuple[Any, ...]]]]:
    rng = random.Random(spec.seed)
    outcomes, weights = list(OUTCOME_WEIGHTS), list(OUTCOME_WEIGHTS.values())
    n = spec.tokens_per_call
    ids = np.arange(n, dtype="<i4") + 100
    prompt_blob = ids.tobytes()
    lp_blob = np.full(n, -0.7, dtype="<f4").tobytes()
    tools = [{"type": "function", "function": {"name": "bash", "parameters": {"type": "object"}}}]
    now = time.time()
    for step in range(spec.steps):
        splits = [("train", spec.rollouts_per_step)]
        if spec.eval_every and step % spec.eval_every == spec.eval_every - 1:
            splits.append(("eval-heldout", max(1, spec.rollouts_per_step // 4)))
        for split, count in splits:
            for r in range(count):
                g, sample = divmod(r, spec.group_size)
                task = f"synthetic-{rng.randrange(spec.tasks):04d}"
                harness = HARNESSES[r % len(HARNESSES)]
                rid = f"s{step}-{split[:1]}{r}-{task}"
                # pass rate grows over steps; turns grow a little too
                p_res = min(0.9, OUTCOME_WEIGHTS["resolved"] + step / max(spec.steps, 1) * 0.4)
                o = "resolved" if rng.random() < p_res else rng.choices(outcomes[1:], weights[1:])[0]
                reward = (1.0 if o == "resolved" else 0.0) if o in TRAINED else None
                n_calls = 0 if o == "no_model_calls" else rng.randint(1, 2 * spec.calls_per_rollout - 1)
                report = {"resolved": o == "resolved", "outcome": o if o in ("resolved", "grader_error") else
                          "unresolved", "reason": "synthetic", "tests": {"tests/test_x.py::test_a": "passed",
                                                                          "tests/test_x.py::test_b":
                                                                          "passed" if o == "resolved" else "failed"},
                          "applied_paths": ["pkg/mod.py"], "dropped_paths": [], "collected": 2, "exit_code": 0,
                          "log_tail": "2 passed"}
                timings = {"setup_s": 0.5, "agent_s": 3.0 + n_calls, "grading_s": 1.2, "total_s": 4.7 + n_calls}
                rollout = (rid, step, task, f"{step}:{split}:{g}", sample, harness, split, o,
                           f"synthetic {o}: {rng.randrange(5)} of 2 tests failed" if o != "resolved" else "all passed",
                           reward, "--- a/pkg/mod.py\n+++ b/pkg/mod.py\n@@ -1 +1 @@\n-a + b\n+a - b\n",
                           json.dumps(report), step, step, json.dumps(timings), now, now)
                messages: list[dict[str, Any]] = [{"role": "system", "content": "You are a coding agent."},
                                                  {"role": "user", "content": f"Fix {task}."}]
                calls = []
                for k in range(n_calls):
                    cmd = SCRIPT[k % len(SCRIPT)] if k < n_calls - 1 else SCRIPT[-1]
                    text_only = o == "max_turns" and k % 3 == 2
                    tcs = [] if text_only else [_tool_call(harness, cmd, k)]
                    req = {"model": "legorl-policy", "tools": tools,
                           "messages": messages if spec.full_history else messages[-1:]}
                    calls.append((rid, k, "openai_chat", json.dumps(req), prompt_blob, prompt_blob, lp_blob,
                                  "stop", step, "I will run a command." if text_only else "",
                                  json.dumps(tcs), k - 1 if k else None, None, 0, 1, None, now, now + 0.2))
                    if spec.full_history:
                        messages = messages + [
                            {"role": "assistant", "content": "",
                             "tool_calls": [{"id": t["id"], "type": "function",
                                             "function": {"name": t["name"], "arguments": t["arguments"]}}
                                            for t in tcs]},
                        ] + ([{"role": "tool", "tool_call_id": tcs[0]["id"], "content": f"output {k}"}] if tcs else
                             [{"role": "user", "content": "No tool calls found in the response."}])
                yield split, rollout, calls


def _step_metrics(step: int, spec: SyntheticSpec, rng: random.Random, outcomes: dict[str, int]) -> dict[str, float]:
    m = {f"outcomes/{o.value}": float(outcomes.get(o.value, 0)) for o in Outcome}
    frac = step / max(spec.steps - 1, 1)
    m.update({"rollouts/count": float(spec.rollouts_per_step), "rollouts/trained": float(spec.rollouts_per_step),
              "reward/mean": 0.3 + 0.4 * frac, "pass_rate": 0.3 + 0.4 * frac,
              "rollouts/turns_mean": float(spec.calls_per_rollout), "rollouts/completion_tokens_mean": 60.0,
              "seq/tokens_unmerged": 4000.0, "train/rollouts": float(spec.rollouts_per_step),
              "train/loss": 0.1 * rng.random(), "train/grad_norm": 1.0 + rng.random(), "train/clip_frac": 0.01,
              "train/logprob_pearson": 0.999 - 0.001 * rng.random(), "train/mismatch_k3_kl": 1e-4 * (1 + rng.random()),
              "train/mismatch_abs_dlogp_mean": 0.01, "train/is_ess": 0.98, "time/rollout_s": 30.0 + rng.random(),
              "time/train_s": 8.0, "time/sync_s": 0.5, "time/step_s": 40.0, "weight_version": float(step + 1)})
    return m


def build_synthetic_store(path: str | Path, spec: SyntheticSpec | None = None) -> dict[str, int]:
    """Write a store at `path` (created; must not exist). Returns counts of rows written."""
    spec = spec or SyntheticSpec()
    path = Path(path)
    if path.exists():
        raise FileExistsError(f"{path} exists: give build_synthetic_store a fresh path")
    with Store(path) as store:
        store.add_run("synthetic", {"run": {"name": "synthetic"}})
    conn = sqlite3.connect(str(path))
    conn.execute("PRAGMA synchronous=OFF")
    rng = random.Random(spec.seed + 1)
    n_rollouts = n_calls = 0
    rollouts: list[tuple[Any, ...]] = []
    calls: list[tuple[Any, ...]] = []

    def flush() -> None:
        conn.executemany("INSERT INTO rollouts (id, step, task_id, group_id, sample_index, harness, split, outcome, "
                         "outcome_reason, reward, diff, report_json, weight_version_start, weight_version_end, "
                         "timings_json, created, updated) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                         rollouts)
        conn.executemany("INSERT INTO llm_calls (rollout_id, idx, wire_format, request_json, prompt_ids, "
                         "completion_ids, completion_logprobs, finish_reason, weight_version, completion_text, "
                         "tool_calls_json, parent_index, segment_break, naive_prompt_differs, sampled_from_policy, "
                         "routed_experts, t_start, t_end) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                         calls)
        rollouts.clear()
        calls.clear()

    counts: dict[int, dict[str, int]] = {}
    for split, rollout, rcalls in _rows(spec):
        if split == "train":
            per = counts.setdefault(rollout[1], {})
            per[rollout[7]] = per.get(rollout[7], 0) + 1
        rollouts.append(rollout)
        calls.extend(rcalls)
        n_rollouts += 1
        n_calls += len(rcalls)
        if len(calls) > 50_000:
            flush()
    flush()
    conn.executemany("INSERT OR REPLACE INTO steps (step, t, metrics_json) VALUES (?, ?, ?)",
                     [(s, time.time(), json.dumps(_step_metrics(s, spec, rng, counts.get(s, {})))) for s in range(spec.steps)])
    conn.commit()
    conn.close()
    return {"rollouts": n_rollouts, "calls": n_calls, "steps": spec.steps}
