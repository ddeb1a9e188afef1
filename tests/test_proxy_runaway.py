"""Requests that stop costing: a client that goes away has its generation cancelled and its call recorded as
abandoned (never trained, a retry is what counts); a prompt that cannot fit the context is refused before
it is tokenized whole; large prompts are tokenized off the event loop. Real uvicorn on loopback: a real
disconnect needs a real server socket."""

from __future__ import annotations

import asyncio
import json
import re
import threading

import httpx
import openai
import pytest
from helpers import wait_until_async
from test_proxy import Harness, check_fidelity

from legorl.engine import LocalEngine, ScriptedEngine
from legorl.models import build_model
from legorl.proxy.server import SamplingOverride
from legorl.records import ABANDONED
from legorl.rollout.outcomes import capture_problem
from legorl.store import Store
from legorl.train.sequences import build_sequences

pytestmark = pytest.mark.usefixtures("one_torch_thread")


async def raw_post(port: int, path: str, body: dict) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """Send one request on a socket of our own, so the test decides when the client goes away."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    data = json.dumps(body).encode()
    writer.write(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    await writer.drain()
    return reader, writer


async def hang_up(writer: asyncio.StreamWriter) -> None:
    writer.close()
    await writer.wait_closed()


class Recorder(Harness):
    """A proxy on loopback whose calls go to a list and to a store."""

    def __init__(self, engine, tok, store: Store, **kw):
        super().__init__(engine, tok, **kw)
        self.proxy.on_call = lambda c: (self.calls.append(c), store.add_call(c))


@pytest.mark.parametrize("stream", [True, False], ids=["streaming", "non-streaming"])
def test_client_gone_cancels_generation_and_records_abandoned(tokenizer, tiny_spec, tmp_path, stream):
    """A client hangs up mid-generation: the engine drops its sequence well before max_tokens, the call is
    recorded as abandoned and left out of training; another session is answered meanwhile."""
    store = Store(tmp_path / "store.sqlite")
    cap = 30_000  # far more tokens than the test takes to hang up, even on a fast machine
    spec = tiny_spec.model_copy(update={"max_position_embeddings": 32_768})

    async def main():
        # No stop ids: a random model could end its turn at any token; this generation must run until cancelled.
        engine = LocalEngine(build_model(spec, tokenizer), tokenizer, stop_token_ids=[], max_batch=2)
        try:
            h = Recorder(engine, tokenizer, store, sampling=SamplingOverride(temperature=1.0, max_tokens=cap),
                         keepalive_s=0.05)
            async with h:
                a, b = h.proxy.open_session("gone"), h.proxy.open_session("other")
                body = {"model": "m", "messages": [{"role": "user", "content": "count to a million"}],
                        "max_tokens": cap, "stream": stream}
                reader, writer = await raw_post(h.proxy.port, f"/s/{a.token}/v1/chat/completions", body)
                if stream:  # the SSE stream has begun (keep-alive comments), no answer yet
                    head = await asyncio.wait_for(reader.readuntil(b": keep-alive"), 60)
                    assert b"text/event-stream" in head
                assert await wait_until_async(lambda: engine.stats()["generated_tokens"] > 0, timeout=60)
                # another session is answered while the long generation runs
                client = openai.AsyncOpenAI(base_url=h.proxy.openai_base_url(b.token), api_key="x")
                r = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}],
                                                         max_tokens=3)
                assert r.choices[0].finish_reason == "length"
                assert h.proxy.in_flight == 1  # the long one still runs (the engine drops b's row after answering)
                assert await wait_until_async(lambda: engine.stats()["active"] == 1)
                await hang_up(writer)
                assert await wait_until_async(lambda: engine.stats()["cancelled"] == 1, timeout=60)
                assert await wait_until_async(lambda: h.proxy.in_flight == 0 and engine.stats()["active"] == 0)
        finally:
            await engine.close()
        return engine.stats(), h, a, b

    stats, h, a, b = asyncio.run(main())
    prompt_len = len(next(c for c in h.calls if c.rollout_id == "gone").prompt_ids)
    assert stats["generated_tokens"] < min(cap, 32_768 - prompt_len)  # stopped early: fewer than its max_tokens
    (gone,) = [c for c in h.calls if c.rollout_id == "gone"]
    assert gone.finish_reason == ABANDONED and gone.completion_ids == [] and gone.completion_logprobs == []
    assert gone.index == 0 and gone.prompt_ids and gone.request["max_tokens"] == cap
    assert a.errors == [ABANDONED] and a.n_calls == 0 and b.errors == [] and b.n_calls == 1
    assert h.proxy.stats()["errors"] == {ABANDONED: 1}
    # visible in the store and the export as abandoned, never among the calls outcomes and training read
    assert store.calls_for("gone") == [] and [c.finish_reason for c in store.calls_for("gone", abandoned=True)] == [
        ABANDONED]
    assert build_sequences("gone", store.calls_for("gone", abandoned=True), 1.0) == []
    rep = store.report(decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=False))
    assert rep["abandoned_calls"] == 1 and rep["llm_calls"] == 1 and rep["fidelity"]["violations"] == 0
    store.export_calls_jsonl(tmp_path / "calls.jsonl")
    exported = [json.loads(line) for line in (tmp_path / "calls.jsonl").read_text().splitlines()]
    assert sorted(c["finish_reason"] for c in exported) == [ABANDONED, "length"]
    check_fidelity(tokenizer, [c for c in h.calls if c.rollout_id == "other"])


class GatedEngine(ScriptedEngine):
    """A scripted engine whose `gated`-th generation never ends by itself (it waits to be cancelled);
    results count as sampled from the policy, as a policy engine's do."""

    def __init__(self, tokenizer, gated: int):
        super().__init__(tokenizer)
        self.gated = gated
        self.started = 0
        self.cancelled = 0

    async def generate(self, prompt_ids, params, *, rollout_id=""):
        self.started += 1
        if self.started == self.gated:
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                self.cancelled += 1
                raise
        r = await super().generate(prompt_ids, params, rollout_id=rollout_id)
        r.sampled_from_policy = True
        return r


def test_retry_of_an_abandoned_call_is_what_trains(tokenizer, tmp_path):
    """The harness's SDK gives up on a call and re-sends it: the retry is answered, recorded under the same
    index and trained; the abandoned attempt is kept for the record only."""
    store = Store(tmp_path / "store.sqlite")

    async def main():
        engine = GatedEngine(tokenizer, gated=2)
        engine.set_script("r", ["one", "two", "three"])
        async with Recorder(engine, tokenizer, store) as h:
            s = h.proxy.open_session("r")
            url = h.proxy.openai_base_url(s.token) + "/chat/completions"
            msgs = [{"role": "user", "content": "go"}]
            async with httpx.AsyncClient() as http:
                r0 = (await http.post(url, json={"model": "m", "messages": msgs})).json()
                msgs += [r0["choices"][0]["message"], {"role": "user", "content": "more"}]
                body = {"model": "m", "messages": msgs}
                _, writer = await raw_post(h.proxy.port, f"/s/{s.token}/v1/chat/completions", body)
                assert await wait_until_async(lambda: engine.started == 2)
                await hang_up(writer)
                assert await wait_until_async(lambda: engine.cancelled == 1 and h.proxy.in_flight == 0)
                r1 = await http.post(url, json=body, headers={"x-stainless-retry-count": "1"})
                assert r1.json()["choices"][0]["message"]["content"] == "two"
        return h, s

    h, s = asyncio.run(main())
    first, abandoned, retry = h.calls
    assert abandoned.finish_reason == ABANDONED and (abandoned.index, retry.index) == (1, 1)
    assert abandoned.prompt_ids == retry.prompt_ids and abandoned.parent_index == retry.parent_index == 0
    assert s.n_calls == 2 and s.errors == [ABANDONED] and s.retries_answered == 0  # sampled afresh
    calls = store.calls_for("r")
    assert [(c.index, c.completion_text) for c in calls] == [(0, first.completion_text), (1, retry.completion_text)]
    assert capture_problem(calls, s.n_calls) == ""  # the capture of the rollout is whole: it trains
    (seq,) = build_sequences("r", calls, 1.0)
    assert build_sequences("r", store.calls_for("r", abandoned=True), 1.0) == [seq]
    assert seq.token_ids == retry.prompt_ids + retry.completion_ids and sum(seq.loss_mask) == (
        len(first.completion_ids) + len(retry.completion_ids))
    check_fidelity(tokenizer, calls)


class CountingTokenizer:
    """The tokenizer, noting the length of every text it is asked to tokenize (all entry points)."""

    def __init__(self, tok):
        self._tok = tok
        self.seen: list[int] = []

    def __getattr__(self, name):
        return getattr(self._tok, name)

    def encode(self, text, *a, **kw):
        self.seen.append(len(text))
        return self._tok.encode(text, *a, **kw)

    def __call__(self, text, *a, **kw):
        self.seen.append(len(text))
        return self._tok(text, *a, **kw)

    @property
    def backend_tokenizer(self):
        return _CountingBackend(self._tok.backend_tokenizer, self.seen)


class _CountingBackend:
    def __init__(self, backend, seen):
        self._b, self._seen = backend, seen

    def __getattr__(self, name):
        return getattr(self._b, name)

    def encode(self, text, *a, **kw):
        self._seen.append(len(text))
        return self._b.encode(text, *a, **kw)

    def encode_batch(self, texts, *a, **kw):
        self._seen.extend(len(t) for t in texts)
        return self._b.encode_batch(texts, *a, **kw)


def overflow_requests(text: str) -> list[tuple[str, dict]]:
    return [("/chat/completions", {"model": "m", "messages": [{"role": "user", "content": text}]}),
            ("/responses", {"model": "m", "input": text, "stream": True}),
            ("/messages", {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": text}]})]


def check_overflow_shapes(replies: list[httpx.Response]) -> None:
    chat, responses, anthropic = replies
    assert [r.status_code for r in replies] == [400, 400, 400]
    err = chat.json()["error"]
    assert err["code"] == "context_length_exceeded" and err["param"] == "messages"
    assert "maximum context length is 4096 tokens" in err["message"] and "your messages resulted in at least" in err[
        "message"]
    err = responses.json()["error"]  # the Responses format carries the conversation in `input`
    assert err["code"] == "context_length_exceeded" and err["param"] == "input"
    assert "your input resulted in at least" in err["message"] and "messages" not in err["message"]
    body = anthropic.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert re.fullmatch(r"prompt is too long: \d+ tokens > 4096 maximum", body["error"]["message"])


def test_ten_megabyte_prompt_is_refused_without_tokenizing_it(tokenizer):
    """A 10 MB prompt against a 4096-token context: refused in each format's overflow shape, from its
    length alone (no tokenizer call sees it), recorded as context_overflow; the proxy keeps serving."""
    counting = CountingTokenizer(tokenizer)
    big = "lorem ipsum " * (10_000_000 // 12)

    async def main():
        engine = ScriptedEngine(tokenizer, max_context=4096)
        engine.set_script("r", ["fine"])
        async with Harness(engine, counting) as h:
            s = h.proxy.open_session("r")
            base = h.proxy.openai_base_url(s.token)
            async with httpx.AsyncClient(timeout=120) as http:
                replies = [await http.post(base + path, json=body) for path, body in overflow_requests(big)]
                assert counting.seen == []  # refused from its length: not one tokenizer call
                r = await http.post(base + "/chat/completions",
                                    json={"model": "m", "messages": [{"role": "user", "content": "hi"}]})
                assert r.json()["choices"][0]["message"]["content"] == "fine"
                assert counting.seen  # the counting wrapper does see what the proxy tokenizes
        return h, s, replies

    counting.seen.clear()
    h, s, replies = asyncio.run(main())
    check_overflow_shapes(replies)
    assert s.errors == ["context_overflow"] * 3 and len(h.calls) == 1


def test_suspect_prompt_is_counted_piecewise_and_refused_early(tokenizer):
    """Text short enough to pass the length bound but too long for the context: its tokens are counted in
    pieces, stopping past the context, so the refusal costs a fraction of tokenizing it whole."""
    counting = CountingTokenizer(tokenizer)
    text = "word " * 20_000  # 100 kB: about 20k tokens, over 4096, under the length bound (29 bytes a token)

    async def main():
        engine = ScriptedEngine(tokenizer, max_context=4096)
        async with Harness(engine, counting) as h:
            s = h.proxy.open_session("r")
            assert len(text) < 4096 * h.proxy.core.max_token_bytes()
            async with httpx.AsyncClient(timeout=120) as http:
                replies = [await http.post(h.proxy.openai_base_url(s.token) + path, json=body)
                           for path, body in overflow_requests(text)]
        return s, replies

    s, replies = asyncio.run(main())
    check_overflow_shapes(replies)
    assert s.errors == ["context_overflow"] * 3
    assert counting.seen and sum(counting.seen) <= 3 * len(text) // 2  # 3 refusals, each tokenized a part


def test_large_prompt_is_tokenized_off_the_event_loop(tokenizer):
    """A large prompt that fits is rendered and tokenized in a worker thread (the loop keeps serving other
    sessions); a small one stays on the loop. Both are answered token-exactly."""
    threads: list[bool] = []

    async def main():
        engine = ScriptedEngine(tokenizer)  # a context of 1M tokens
        engine.set_script("r", ["big", "small"])
        async with Harness(engine, tokenizer) as h:
            build = h.proxy.core.bridge.build

            def noting_build(*a, **kw):
                threads.append(threading.current_thread() is threading.main_thread())
                return build(*a, **kw)

            h.proxy.core.bridge.build = noting_build
            s = h.proxy.open_session("r")
            client = openai.AsyncOpenAI(base_url=h.proxy.openai_base_url(s.token), api_key="x")
            msgs = [{"role": "user", "content": "print('hello world')\n" * 1_000}]  # 21 kB
            r = await client.chat.completions.create(model="m", messages=msgs)
            assert r.choices[0].message.content == "big"
            msgs += [{"role": "assistant", "content": "big"}, {"role": "user", "content": "ok"}]
            r = await client.chat.completions.create(model="m", messages=msgs[-1:])
            assert r.choices[0].message.content == "small"
        return h

    h = asyncio.run(main())
    assert threads == [False, True]  # on the main thread: the event loop's
    check_fidelity(tokenizer, h.calls)


def test_body_without_length_is_cut_off_at_the_limit(tokenizer):
    """A chunked body (no content-length) over the body limit is refused once the limit is passed."""
    async def main():
        async with Harness(ScriptedEngine(tokenizer), tokenizer, max_body_bytes=1 << 20) as h:
            s = h.proxy.open_session("r")
            sent = 0

            async def chunks():
                nonlocal sent
                yield b'{"model": "m", "messages": [{"role": "user", "content": "'
                for _ in range(64):
                    sent += 1 << 16
                    yield b"x" * (1 << 16)
                yield b'"}]}'

            async with httpx.AsyncClient() as http:
                r = await http.post(h.proxy.openai_base_url(s.token) + "/chat/completions", content=chunks())
            assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
            assert "over 1048576 bytes" in r.json()["error"]["message"]

    asyncio.run(main())
