"""`legorl proxy` standalone: new session ids on first use, every call recorded, `legorl report` fidelity."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
from pathlib import Path

import anthropic
import openai
import pytest
from helpers import SIGINT_IGNORED, wait_until

from legorl.models import render_tool_call_text


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Started with SIGINT ignored, as bash starts a script's background job (and as `make test` ran in the
# background once found it: the proxy served both calls, then never exited), Ctrl-C still stops it; so does SIGTERM.
@pytest.mark.parametrize("stop_signal", [signal.SIGINT, signal.SIGTERM], ids=["sigint-inherited-ignored", "sigterm"])
def test_standalone_proxy_records_any_harness(tmp_path, tokenizer, stop_signal):
    script = tmp_path / "replies.json"
    script.write_text(json.dumps([render_tool_call_text("bash", {"command": "ls"}), "done"]))
    port = _free_port()
    run_dir = tmp_path / "run"
    tokenizer.save_pretrained(tmp_path / "tok")  # the scripted engine only needs a tokenizer dir
    legorl = str(Path(sys.executable).with_name("legorl"))
    proc = subprocess.Popen([*SIGINT_IGNORED, legorl, "proxy", "--engine", "scripted", "--script", str(script),
                             "--port", str(port), "--run-dir", str(run_dir), "--model", str(tmp_path / "tok")],
                            stderr=subprocess.PIPE, text=True)
    try:

        def listening() -> bool:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
            except OSError:
                assert proc.poll() is None, proc.stderr.read()
                return False
            return True

        assert wait_until(listening, timeout=120, interval=0.3), "the proxy never listened"
        oa = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/s/sft-1/v1", api_key="unused")
        msgs = [{"role": "user", "content": "list files"}]
        r = oa.chat.completions.create(model="any", messages=msgs, tools=[{"type": "function", "function": {
            "name": "bash", "parameters": {"type": "object", "properties": {"command": {"type": "string"}}}}}])
        tc = r.choices[0].message.tool_calls[0]
        assert tc.function.name == "bash"
        an = anthropic.Anthropic(base_url=f"http://127.0.0.1:{port}", api_key="sft-2")
        m = an.messages.create(model="any", max_tokens=50, messages=[{"role": "user", "content": "hi"}],
                               tools=[{"name": "bash", "input_schema": {"type": "object"}}])
        assert m.content[0].type == "tool_use"  # each session replays the script from its start
        oa.close()  # no idle keep-alive connection left for the server's shutdown to wait on
        an.close()
    finally:
        proc.send_signal(stop_signal)
        _, err = proc.communicate(timeout=120)
    stats = json.loads(err[err.index("{"):])
    assert stats["calls"] == 2 and stats["by_format"] == {"openai_chat": 1, "anthropic_messages": 1}
    out = subprocess.run([legorl, "report", str(run_dir), "--json"], capture_output=True, text=True, check=True)
    fid = json.loads(out.stdout)["fidelity"]
    assert fid["checked"] == 2 and fid["violations"] == 0
    assert (fid["segments"], fid["bridge_hits"], fid["drift_prevented"]) == (2, 0, 0)


def test_tools_first_lays_out_the_builtin_template_and_refuses_a_model_dir(tmp_path, cache_dir, tokenizer):
    from typer.testing import CliRunner

    from legorl.cli import app
    from legorl.models.chat_template import chat_template
    from legorl.proxy.cli import _engine_and_tokenizer

    _, tok = _engine_and_tokenizer("scripted", None, None, cache_dir, tools_first=True)
    assert tok.chat_template == chat_template(tools_first=True) != tokenizer.chat_template
    tools = [{"type": "function", "function": {"name": "bash", "parameters": {"type": "object"}}}]
    text = tok.apply_chat_template([{"role": "system", "content": "SYS"}, {"role": "user", "content": "hi"}],
                                   tools=tools, tokenize=False)
    assert text.index('"bash"') < text.index("SYS")  # the tool section, then the system message
    tokenizer.save_pretrained(tmp_path / "tok")
    out = CliRunner().invoke(app, ["proxy", "--run-dir", str(tmp_path / "run"), "--model", str(tmp_path / "tok"),
                                   "--tools-first"])
    assert out.exit_code == 2 and "--tools-first" in out.output and "brings its own" in out.output
    assert not (tmp_path / "run").exists()  # refused before anything was written
