"""Trainer throughput: legorl's Trainer vs TRL's GRPOTrainer, and vs the matmul ceiling, in one run.

Same model (the built-in tiny Qwen3, or --hidden/--layers for a larger one), same token batches
(prompt + sampled completion, advantages +-1), same micro-batch size, AdamW, fp32 on CPU:

- legorl: ``Trainer.train_step`` (PPO-clip + token TIS, mismatch metrics, per-rollout weights).
- TRL: ``GRPOTrainer.compute_loss`` + backward + optimizer step on the same batches, i.e. TRL's
  training forward/backward only (its generation is excluded; TRL computes the lm_head on the
  completion positions only, ``logits_to_keep``).
- ceiling: ``torch.matmul`` FLOP/s on a square fp32 matmul measured in the same process; the
  trainer's achieved FLOP/s counts 6 x (matmul parameters) per token + attention (12 x L x d x T).

TRL is optional: ``pip install trl accelerate psutil --no-deps`` into the venv (keeps the CPU torch).

    .venv/bin/python bench/trainer.py
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import transformers

from legorl.records import TrainingSequence
from legorl.train.logprobs import sequence_logprobs
from legorl.train.trainer import Trainer


def build(vocab: int, hidden: int, layers: int) -> transformers.Qwen3ForCausalLM:
    cfg = transformers.Qwen3Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=3 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=max(1, hidden // 32),
        num_key_value_heads=max(1, hidden // 64),
        head_dim=32,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
    )
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return transformers.Qwen3ForCausalLM(cfg).float()


def matmul_flops(model: torch.nn.Module) -> int:
    """Parameters that take part in a matmul (every Linear, the lm_head; not the embedding lookup)."""
    return sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))


def train_flops(model: transformers.PreTrainedModel, n_seqs: int, seq_len: int) -> float:
    cfg = model.config
    tokens = n_seqs * seq_len
    attn = 12 * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim * seq_len / 2  # causal
    return tokens * (6 * matmul_flops(model) + attn)


def matmul_ceiling(n: int = 1024, reps: int = 20) -> float:
    a, b = torch.randn(n, n), torch.randn(n, n)
    for _ in range(3):
        a @ b
    t = time.perf_counter()
    for _ in range(reps):
        a @ b
    return 2 * n**3 * reps / (time.perf_counter() - t)


def make_batches(
    model: torch.nn.Module, n_batches: int, batch: int, prompt: int, completion: int, vocab: int
) -> list[list[TrainingSequence]]:
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n_batches):
        ids = torch.randint(1, vocab, (batch, prompt + completion), generator=g)
        with torch.no_grad():
            lp, _ = sequence_logprobs(model, ids, torch.ones_like(ids), 1.0)
        seqs = []
        for i in range(batch):
            mask = [0] * prompt + [1] * completion
            lps = [0.0] + [float(x) if m else 0.0 for x, m in zip(lp[i].tolist(), mask[1:])]
            seqs.append(TrainingSequence(f"r{i}", ids[i].tolist(), mask, lps, 1.0 if i % 2 else -1.0))
        out.append(seqs)
    return out


Step = Callable[[list[TrainingSequence]], None]


def legorl_step(model: torch.nn.Module, tokens_per_batch: int) -> Step:
    tr = Trainer(model, lr=1e-5, micro_batch_tokens=tokens_per_batch)

    def step(seqs: list[TrainingSequence]) -> None:
        tr.train_step(seqs)

    return step


def trl_step(
    model: torch.nn.Module, batch: int, prompt: int, completion: int, tok_dir: Path, out: str
) -> Step | str:
    """TRL's GRPOTrainer loss (compute_loss) + backward + clip + AdamW step on the given tokens."""
    try:
        from datasets import Dataset
        from trl import GRPOConfig, GRPOTrainer
    except Exception as e:  # noqa: BLE001 - optional peer
        return f"skipped: TRL not importable ({type(e).__name__}: {e})"
    from legorl.models import build_tokenizer

    args = GRPOConfig(
        output_dir=out,
        use_cpu=True,
        per_device_train_batch_size=batch,
        num_generations=batch,
        max_completion_length=completion,
        beta=0.0,
        bf16=False,  # fp32 like legorl's default; TRL's own default is bf16 autocast
        gradient_checkpointing=False,  # TRL's default recomputes activations; legorl's does not
        learning_rate=1e-5,
        report_to=[],
        logging_steps=10**6,
        save_strategy="no",
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=lambda completions, **kw: [0.0] * len(completions),
        args=args,
        train_dataset=Dataset.from_dict({"prompt": ["x"] * batch}),
        processing_class=build_tokenizer(tok_dir, 4096),
    )
    trainer.create_optimizer()
    trainer.current_gradient_accumulation_steps = 1  # set by Trainer.train() otherwise
    opt = trainer.optimizer
    model.train()

    def step(seqs: list[TrainingSequence]) -> None:
        ids = torch.tensor([s.token_ids for s in seqs])
        inputs = {
            "prompt_ids": ids[:, :prompt],
            "prompt_mask": torch.ones_like(ids[:, :prompt]),
            "completion_ids": ids[:, prompt:],
            "completion_mask": torch.ones_like(ids[:, prompt:]),
            "advantages": torch.tensor([s.advantage for s in seqs]),
            "num_items_in_batch": torch.tensor(float(ids[:, prompt:].numel())),
        }
        loss = trainer.compute_loss(model, inputs)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def timed(step: Step, seqs: list[TrainingSequence]) -> float:
    t = time.perf_counter()
    step(seqs)
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--completion", type=int, default=128)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--cache-dir", default=str(Path.home() / ".cache" / "legorl"))
    args = ap.parse_args()

    base = build(args.vocab, args.hidden, args.layers)
    batches = make_batches(
        base, args.steps + args.warmup, args.batch, args.prompt, args.completion, args.vocab
    )
    seq_len = args.prompt + args.completion
    flops_per_batch = train_flops(base, args.batch, seq_len)
    tokens_per_batch = args.batch * seq_len

    # Steps of the two trainers and matmul probes alternate, so a load change on this shared machine
    # hits every figure alike.
    ours_step = legorl_step(build(args.vocab, args.hidden, args.layers), tokens_per_batch)
    tmp = tempfile.TemporaryDirectory()
    trl = trl_step(
        build(args.vocab, args.hidden, args.layers),
        args.batch,
        args.prompt,
        args.completion,
        Path(args.cache_dir),
        tmp.name,
    )
    t_ours = t_trl = 0.0
    ceilings = []
    for i, b in enumerate(batches):
        a = timed(ours_step, b)
        c = timed(trl, b) if not isinstance(trl, str) else 0.0
        ceilings.append(matmul_ceiling(reps=5))
        if i >= args.warmup:
            t_ours, t_trl = t_ours + a, t_trl + c
    tmp.cleanup()
    ceiling = max(ceilings)
    ours = args.steps * tokens_per_batch / t_ours
    trl_tps = args.steps * tokens_per_batch / t_trl if not isinstance(trl, str) else trl

    def achieved(tps: float) -> float:
        return tps / tokens_per_batch * flops_per_batch

    print(
        f"model: Qwen3 hidden {args.hidden}, {args.layers} layers, vocab {args.vocab} "
        f"({matmul_flops(base) / 1e6:.2f}M matmul params); batch {args.batch} x ({args.prompt} prompt + "
        f"{args.completion} completion) tokens, {args.steps} timed steps, fp32, "
        f"{torch.get_num_threads()} threads"
    )
    print(f"matmul ceiling (1024^3 fp32, best probe): {ceiling / 1e9:.1f} GFLOP/s\n")
    print(f"{'trainer':<28} {'tokens/s':>10} {'GFLOP/s':>9} {'of ceiling':>11}")
    print(
        f"{'legorl Trainer.train_step':<28} {ours:>10.0f} {achieved(ours) / 1e9:>9.2f} "
        f"{achieved(ours) / ceiling:>11.1%}"
    )
    if isinstance(trl_tps, str):
        print(f"{'TRL GRPOTrainer':<28} {trl_tps}")
    else:
        print(
            f"{'TRL GRPOTrainer (loss+step)':<28} {trl_tps:>10.0f} {achieved(trl_tps) / 1e9:>9.2f} "
            f"{achieved(trl_tps) / ceiling:>11.1%}"
        )
        print(f"\nlegorl / TRL tokens/s: {ours / trl_tps:.2f}x")
    print(
        f"matmul probes: {min(ceilings) / 1e9:.1f}-{ceiling / 1e9:.1f} GFLOP/s; load average {os.getloadavg()[0]:.1f}"
    )


if __name__ == "__main__":
    main()
