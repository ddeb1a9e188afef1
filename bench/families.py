"""Per model family: does a 10-turn tool session bridge, round-trip and train? (`python bench/families.py`)

For each family of tests/families.py (a template written from the family's documented tool-call syntax, a tokenizer
with its special tokens, a tiny random model of its architecture, saved as a checkpoint directory), the preflight's
simulated session (legorl.preflight.simulate_session: the token bridge and the family's parser, as the proxy runs
them) is counted, the embedded LocalEngine samples a few tokens (its fast path or the HF fallback), a proxy
answers the family's tool call in every wire format, streamed and not (the calls read, the next one bridged:
tests/test_families.py's sessions), and the tiny model runs one forward and one Trainer step on the session's
tokens (its replies trained, their logprobs those of the forward). Prints a markdown table. No downloads; about 30
CPU-seconds in all.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "tests"))  # the family checkpoints are the tests' (tests/families.py)

import torch
from families import ARCHITECTURE, DETECTED, FAMILIES, NO_TOOLS, save_checkpoint
from test_families import LS, USER, WIRES, engine_of, scripted_call
from transformers import AutoModelForCausalLM, AutoTokenizer

from legorl.engine import ScriptedEngine
from legorl.models.chat_format import chat_format
from legorl.preflight import OK, SESSION_TURNS, Session, preflight, simulate_session
from legorl.proxy.server import Proxy
from legorl.records import SamplingParams, TrainingSequence
from legorl.train.trainer import Trainer


def train_once(folder: Path, s: Session) -> str:
    """One forward and one Trainer step of the tiny model on the session's sequence; the loss, or the error."""
    try:
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, local_files_only=True)
        ids = torch.tensor([s.token_ids])
        with torch.no_grad():
            logp = torch.log_softmax(model(ids).logits[0, :-1].float(), -1).gather(-1, ids[0, 1:, None])[:, 0]
        lps = [0.0] + [lp if m else 0.0 for lp, m in zip(logp.tolist(), s.loss_mask[1:])]
        metrics = Trainer(model).train_step([TrainingSequence("r", s.token_ids, s.loss_mask, lps, 1.0)])
    except Exception as e:  # noqa: BLE001 - a family that does not train is a row, not a crash
        return f"error: {type(e).__name__}: {str(e)[:80]}"
    norm = metrics["train/grad_norm"]
    return f"ok: {len(s.token_ids)} tokens, grad norm {norm:.3g}" if math.isfinite(norm) and norm > 0 else \
        f"no update (grad norm {norm})"


def engine_once(folder: Path, tok, fmt) -> str:
    """LocalEngine on the checkpoint samples 4 tokens of a rendered prompt: its backend, tokens and logprobs."""
    async def main():
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, local_files_only=True)
        engine = engine_of(model, tok, fmt)
        prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": USER}], add_generation_prompt=True,
                                                    tokenize=False), add_special_tokens=False)
        try:
            r = await engine.generate(prompt, SamplingParams(max_tokens=4, temperature=1.0, seed=0))
            return engine.backend, r
        finally:
            await engine.close()
    try:
        backend, r = asyncio.run(main())
    except Exception as e:  # noqa: BLE001 - a family the engine does not run is a row, not a crash
        return f"error: {type(e).__name__}: {str(e)[:80]}"
    ok = len(r.completion_ids) == len(r.logprobs) and all(map(math.isfinite, r.logprobs))
    return f"{backend}: {len(r.completion_ids)} tokens" + ("" if ok else ", bad logprobs")


def wires_once(tok) -> str:
    """The family's scripted tool call through the proxy in every wire format, streamed and not: how many read
    the call and bridged the next call onto it."""
    async def one(wire: str, stream: bool) -> bool:
        engine, calls = ScriptedEngine(tok), []
        proxy = Proxy(engine, tok, on_call=calls.append)
        await proxy.start()
        try:
            s = proxy.open_session("r")
            engine.set_script("r", [scripted_call(tok, None), "Two files."])
            got, _ = await WIRES[wire](proxy, s, stream)
            return got == [("bash", LS)] and calls[1].parent_index == 0
        finally:
            await proxy.stop()
    results = []
    for wire in WIRES:
        for stream in (False, True):
            try:
                results.append(asyncio.run(one(wire, stream)))
            except Exception:  # noqa: BLE001 - counted as not read
                results.append(False)
    return f"{sum(results)}/{len(results)}"


def row(family: str, root: Path, train: bool) -> list[str]:
    folder = save_checkpoint(root / family, family)
    tok = AutoTokenizer.from_pretrained(folder)
    fmt = chat_format(tok, folder)
    s = simulate_session(tok, fmt)
    checks = {c.name: c for c in preflight(folder)}
    fast = ", ".join(f"{part} {'yes' if checks[name].status == OK else 'no'}"
                     for part, name in (("engine", "engine fast path"), ("trainer", "trainer fast forward")))
    return [family if family not in DETECTED else f"{family} ({DETECTED[family]})", ARCHITECTURE[family],
            fmt.tool_format, f"{s.extended}/{SESSION_TURNS - 1}", f"{s.round_trips}/{SESSION_TURNS}", str(s.violations),
            fast, engine_once(folder, tok, fmt), wires_once(tok), train_once(folder, s) if train else "skipped"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--no-train", action="store_true", help="skip the forward and Trainer step")
    args = ap.parse_args()
    torch.manual_seed(0)
    head = ["family", "architecture", "tool format", "continued calls extending", "round trips",
            "fidelity violations", "fast forward", "engine (4 tokens)", "wire formats x stream",
            "forward + train step"]
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    with tempfile.TemporaryDirectory() as tmp:
        for family in [*FAMILIES, NO_TOOLS]:
            print("| " + " | ".join(row(family, Path(tmp), not args.no_train)) + " |", flush=True)


if __name__ == "__main__":
    main()
