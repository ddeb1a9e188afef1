"""The Engine protocol is the whole surface: every engine implements each member with its signature, and
each proxy session is served by the engine it was opened with, side by side with others."""

from __future__ import annotations

import asyncio
import inspect

import openai
import pytest

from legorl.engine import (
    Engine,
    EngineError,
    LocalEngine,
    ScriptedEngine,
    SGLangEngine,
    UpstreamEngine,
    VLLMEngine,
)
from legorl.engine.base import Weights
from legorl.proxy.server import Proxy, SamplingOverride
from legorl.records import SamplingParams
from legorl.rollout.faults import FaultyEngine

ENGINES = [LocalEngine, VLLMEngine, SGLangEngine, ScriptedEngine, UpstreamEngine, FaultyEngine]
METHODS = {name: f for name, f in vars(Engine).items() if inspect.isfunction(f) and not name.startswith("_")}
PROPERTIES = {name for name, v in vars(Engine).items() if isinstance(v, property)}


def _shape(f):
    """A method's parameters as callers see them: name, kind and default of each."""
    return [(p.name, p.kind, p.default) for p in inspect.signature(f).parameters.values()]


def test_the_protocol_declares_every_member_its_users_call():
    assert set(METHODS) == {"max_context", "generate", "generate_chat", "stats", "update_weights", "weights",
                            "follow", "close"}
    assert PROPERTIES == {"weight_version"}
    assert set(Engine.__annotations__) == {"takes_messages"}


@pytest.mark.parametrize("cls", ENGINES, ids=lambda c: c.__name__)
def test_engine_implements_the_whole_protocol(cls):
    for name, proto in METHODS.items():
        impl = inspect.getattr_static(cls, name, None)
        assert inspect.isfunction(impl), f"{cls.__name__}.{name} is missing"
        assert _shape(impl) == _shape(proto), f"{cls.__name__}.{name}{inspect.signature(impl)}"
        assert inspect.iscoroutinefunction(impl) == inspect.iscoroutinefunction(proto), f"{cls.__name__}.{name}"
    for name in PROPERTIES:  # read-only: only the engine changes its weight version
        prop = inspect.getattr_static(cls, name, None)
        assert isinstance(prop, property) and prop.fset is None, f"{cls.__name__}.{name}"
    declared = inspect.getattr_static(cls, "takes_messages", None)
    assert isinstance(declared, (bool, property)), cls.__name__


def test_engines_without_an_ability_say_so(tokenizer):
    async def main():
        scripted = ScriptedEngine(tokenizer, script=["hi"])
        assert isinstance(scripted, Engine) and not scripted.takes_messages and scripted.stats() == {}
        with pytest.raises(EngineError, match="takes token ids"):
            await scripted.generate_chat([{"role": "user", "content": "hi"}], None, SamplingParams())
        upstream = UpstreamEngine("http://127.0.0.1:9", "m", tokenizer)
        assert upstream.takes_messages and await upstream.update_weights({}, 3) == 0  # not our weights
        with pytest.raises(EngineError, match="conversations"):
            await upstream.generate([1, 2], SamplingParams())
        await upstream.close()
        scripted.follow(Weights(4))  # a Ray worker's engine takes the driver's version
        assert scripted.weight_version == 4 and scripted.weights() == Weights(4)

    asyncio.run(main())


def test_sessions_served_by_different_engines_side_by_side(tokenizer, tiny_spec):
    """A scripted teacher and the policy (a real engine at its own weight version) serve two sessions of one
    proxy at the same time; each call is stamped with its own engine's version, also across an update."""
    from legorl.models import build_model

    async def main():
        policy = LocalEngine(build_model(tiny_spec, tokenizer), tokenizer, max_batch=2)
        teacher = ScriptedEngine(tokenizer)
        nobody = ScriptedEngine(tokenizer)  # the proxy's default engine: it has no script, so it must serve nothing
        calls = []
        proxy = Proxy(nobody, tokenizer, on_call=calls.append, sampling=SamplingOverride(max_tokens=8))
        await proxy.start()
        try:
            assert await policy.update_weights({}, 5) == 5  # e.g. a resumed run's version
            teacher.set_script("demo", ["first", "second"])
            sessions = {"demo": proxy.open_session("demo", teacher), "rl": proxy.open_session("rl", policy)}

            async def turn(rid, i):
                client = openai.AsyncOpenAI(base_url=proxy.openai_base_url(sessions[rid].token), api_key="x",
                                            max_retries=0)
                await client.chat.completions.create(model="m", messages=[{"role": "user", "content": f"{rid} {i}"}])
                await client.close()

            await asyncio.gather(turn("demo", 0), turn("rl", 0))
            async with proxy.paused():  # no call straddles the update
                assert await policy.update_weights({}) == 6
            await asyncio.gather(turn("demo", 1), turn("rl", 1))
        finally:
            await proxy.stop()
            await policy.close()
        by_rollout = {rid: [c for c in calls if c.rollout_id == rid] for rid in ("demo", "rl")}
        assert [c.weight_version for c in by_rollout["demo"]] == [0, 0]
        assert [c.completion_text.removesuffix("<|im_end|>") for c in by_rollout["demo"]] == ["first", "second"]
        assert not any(c.sampled_from_policy for c in by_rollout["demo"])
        assert [c.weight_version for c in by_rollout["rl"]] == [5, 6]
        assert all(c.sampled_from_policy for c in by_rollout["rl"])
        assert nobody.calls("demo") == nobody.calls("rl") == 0

    asyncio.run(main())
