"""The proxy's fast paths (issue 24) give what the slow ones gave."""

from __future__ import annotations

import asyncio
import gc

from legorl.engine import ScriptedEngine
from legorl.models.toolformats.tagged import TaggedJsonParser
from legorl.proxy.bridge import normalize_message
from legorl.proxy.core import CallCore, SamplingOverride
from legorl.proxy.openai_chat import OpenAIChat
from legorl.proxy.server import Proxy
from legorl.proxy.sessions import Session


def test_history_keeps_the_normalised_messages_of_each_call(tokenizer):
    """A call's history entry reuses the bridge's normalised messages: the same as normalising afresh, for a
    first call, a continued one and a rewritten history (a new segment)."""
    async def main():
        engine = ScriptedEngine(tokenizer)
        engine.set_script("r", ["First reply.", "Second reply.", "Third reply."])
        calls = []
        core = CallCore(tokenizer, sampling=SamplingOverride(), parser=TaggedJsonParser(), model_name="m",
                        on_call=calls.append)
        fmt = OpenAIChat(tokenizer)
        session = Session(token="t", rollout_id="r", engine=engine)
        msgs = [{"role": "system", "content": "You are an agent."}, {"role": "user", "content": "Fix it."}]
        for step in range(3):
            req = fmt.parse({"model": "m", "messages": msgs})
            comp = await core.complete(session, req)
            assert session.history[-1].messages == [normalize_message(m) for m in req.messages]
            reply = comp.choices[0].content
            if step == 0:  # continue the conversation
                msgs = msgs + [{"role": "assistant", "content": reply}, {"role": "user", "content": "Go on."}]
            else:  # rewrite it: the first reply is replaced
                msgs = msgs[:2] + [{"role": "assistant", "content": "something else"}, {"role": "user", "content": "?"}]
        assert [c.parent_index for c in calls] == [None, 0, None]
        assert calls[2].segment_break is not None

    asyncio.run(main())


def test_start_freezes_the_startup_heap_once(tokenizer):
    async def main():
        proxy = Proxy(ScriptedEngine(tokenizer), tokenizer)
        await proxy.start()
        try:
            assert gc.get_freeze_count() > 0
            frozen = gc.get_freeze_count()
            again = Proxy(ScriptedEngine(tokenizer), tokenizer)
            await again.start()  # a second proxy in the process does not collect and freeze again
            assert gc.get_freeze_count() == frozen
            await again.stop()
        finally:
            await proxy.stop()

    asyncio.run(main())
