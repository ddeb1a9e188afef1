"""Per model family: does a 10-turn tool session bridge, round-trip and train? (`python bench/families.py`)

For each family of tests/families.py (a template written from the family's documented tool-call syntax, a tokenizer
with its special tokens, a tiny random model of its architecture, saved as a checkpoint directory), the preflight's
simulated session (legorl.preflight.simulate_session: the token bridge and the family's parser, as the proxy runs
them) is counted, and the tiny model runs one forward and one Trainer step on the session's tokens (its replies
trained, their logprobs those of the forward). Prints a markdown table. No downloads; a few seconds on a CPU.
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "tests"))  # the family checkpoints are the tests' (tests/families.py)

import torch
from families import ARCHITECTURE, DETECTED, FAMILIES, NO_TOOLS, save_checkpoint
from transformers import AutoModelForCausalLM, AutoTokenizer

from legorl.models.chat_format import chat_format
from legorl.preflight import OK, SESSION_TURNS, Session, preflight, simulate_session
from legorl.records import TrainingSequence
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
            fast, train_once(folder, s) if train else "skipped"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--no-train", action="store_true", help="skip the forward and Trainer step")
    args = ap.parse_args()
    torch.manual_seed(0)
    head = ["family", "architecture", "tool format", "continued calls extending", "round trips",
            "fidelity violations", "fast forward", "forward + train step"]
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    with tempfile.TemporaryDirectory() as tmp:
        for family in [*FAMILIES, NO_TOOLS]:
            print("| " + " | ".join(row(family, Path(tmp), not args.no_train)) + " |", flush=True)


if __name__ == "__main__":
    main()
