"""Trainer throughput: legorl's Trainer vs TRL's GRPOTrainer, and vs the matmul ceiling, in one run.

Same model (the built-in tiny Qwen3, or --hidden/--layers for a larger one), same token batches
(prompt + sampled completion, advantages +-1), same micro-batch size, AdamW, fp32 on CPU:

- legorl: ``Trainer.train_step`` (PPO-clip + token TIS, mismatch metrics, per-rollout weights), with
  its fused forward (train/fast_forward.py); ``--model-forward`` adds legorl calling the HF model's
  own forward (``fast_forward=False``) to the same run.
- TRL: ``GRPOTrainer.compute_loss`` + backward + optimizer step on the same batches, i.e. TRL's
  training forward/backward only (its generation is excluded; TRL computes the lm_head on the
  completion positions only, ``logits_to_keep``).
- ceiling: ``torch.matmul`` FLOP/s on a square fp32 matmul measured in the same process; the
  trainer's achieved FLOP/s counts 6 x (matmul parameters) per token + attention (12 x L x d x T).

``--shared-prefix``: every batch is one RL group (``--batch`` rollouts sharing a ``--prompt``-token
first prompt, ``--completion``-token continuations); legorl trains it with ``shared_prefix`` on
(the prompt forwarded once) and off (per sequence), and TRL as above. Tokens/s counts every
sequence's tokens, the prompt once per sequence, for all three; GFLOP/s there is per-sequence work.

Threads: torch's OpenMP (libgomp) workers spin-wait between ops by default; on a loaded 2-core
machine a step then waits on descheduled spinners and its time follows the load (3-10x at load 8-17),
so the header prints ``OMP_WAIT_POLICY``; ``OMP_WAIT_POLICY=PASSIVE`` (set before Python starts)
makes them sleep instead. Every trainer and the probe share the process, so same-run ratios stay fair.

TRL is optional: ``pip install trl accelerate psutil --no-deps`` into the venv (keeps the CPU torch).

    .venv/bin/python bench/trainer.py
    .venv/bin/python bench/trainer.py --shared-prefix --prompt 4096 --completion 256 --steps 3 --warmup 1
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

from legorl.models import load_model
from legorl.records import TrainingSequence
from legorl.train.prefix import PrefixGroup, shared_logprobs
from legorl.train.trainer import Trainer


def build(vocab: int, hidden: int, layers: int, max_positions: int = 4096) -> transformers.Qwen3ForCausalLM:
    cfg = transformers.Qwen3Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=3 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=max(1, hidden // 32),
        num_key_value_heads=max(1, hidden // 64),
        head_dim=32,
        max_position_embeddings=max(4096, max_positions),
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
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    attn = 12 * cfg.num_hidden_layers * cfg.num_attention_heads * head_dim * seq_len / 2  # causal
    return tokens * (6 * matmul_flops(model) + attn)


def matmul_ceiling(n: int = 1024, reps: int = 20, dtype: torch.dtype = torch.float32) -> float:
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    for _ in range(3):
        a @ b
    t = time.perf_counter()
    for _ in range(reps):
        a @ b
    return 2 * n**3 * reps / (time.perf_counter() - t)


def make_batches(
    model: torch.nn.Module,
    n_batches: int,
    batch: int,
    prompt: int,
    completion: int,
    vocab: int,
    shared: bool = False,
) -> list[list[TrainingSequence]]:
    """Random token batches with the model's own logprobs; ``shared``: one prompt per batch (a group)."""
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n_batches):
        ids = torch.randint(1, vocab, (batch, prompt + completion), generator=g)
        groups = []
        if shared:
            ids[:, :prompt] = ids[0, :prompt]
            groups = [PrefixGroup(tuple(range(batch)), prompt - 1)]  # the last one predicts a loss token
        loss = torch.zeros(batch, prompt + completion - 1, dtype=torch.bool)
        loss[:, prompt - 1 :] = True
        with torch.no_grad():
            lp, _ = shared_logprobs(model, ids, torch.ones_like(ids), loss, groups, 1.0)
        seqs = []
        for i in range(batch):
            mask = [0] * prompt + [1] * completion
            lps = [0.0] + [float(x) if m else 0.0 for x, m in zip(lp[i].tolist(), mask[1:])]
            seqs.append(TrainingSequence(f"r{i}", ids[i].tolist(), mask, lps, 1.0 if i % 2 else -1.0))
        out.append(seqs)
    return out


Step = Callable[[list[TrainingSequence]], None]


def legorl_step(
    model: torch.nn.Module, tokens_per_batch: int, shared_prefix: bool = True, fast_forward: bool = True,
    autocast: str | None = None,
) -> Step:
    tr = Trainer(
        model,
        lr=1e-5,
        micro_batch_tokens=tokens_per_batch,
        shared_prefix=shared_prefix,
        fast_forward=fast_forward,
        autocast=autocast,
    )

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


def run_alternating(steps: dict[str, Step | str], batches: list, warmup: int,
                    dtype: torch.dtype = torch.float32) -> tuple[dict, list[float]]:
    """Seconds per trainer over the timed batches; steps and matmul probes alternate, so a load change
    on this shared machine hits every figure alike. A str step is a reason it was skipped."""
    spent = {name: 0.0 for name in steps}
    ceilings = []
    for i, b in enumerate(batches):
        for name, step in steps.items():
            dt = timed(step, b) if not isinstance(step, str) else 0.0
            spent[name] += dt if i >= warmup else 0.0
        ceilings.append(matmul_ceiling(reps=5, dtype=dtype))
    return spent, ceilings


def bf16_pearson(model: torch.nn.Module, batches: list[list[TrainingSequence]]) -> tuple[float, float]:
    """The fp32 sampler's logprobs (the batches') against the trainer's under bf16 autocast: Pearson of the
    probabilities and the mean |dlogp| over the loss tokens."""
    from legorl.train.metrics import pearson

    got, want = [], []
    for seqs in batches[:2]:
        ids = torch.tensor([s.token_ids for s in seqs])
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(ids).logits[:, :-1].float()
        lp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])[..., 0]
        for i, s in enumerate(seqs):
            for t, m in enumerate(s.loss_mask[1:], start=1):
                if m:
                    got.append(float(lp[i, t - 1]))
                    want.append(s.rollout_logprobs[t])
    a, b = torch.tensor(got), torch.tensor(want)
    return pearson(a.exp(), b.exp()), float((a - b).abs().mean())


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
    ap.add_argument("--shared-prefix", action="store_true", help="each batch is a group sharing its prompt")
    ap.add_argument(
        "--model-forward",
        action="store_true",
        help="also time legorl with the model's own forward (fast_forward=False), in the same run",
    )
    ap.add_argument("--cache-dir", default=str(Path.home() / ".cache" / "legorl"))
    ap.add_argument("--model", type=Path, default=None,
                    help="a model directory (e.g. ~/.cache/legorl/models/smollm2-135m-instruct) instead of a built Qwen3")
    ap.add_argument("--autocast", choices=["bf16"], default=None,
                    help="also time legorl under bf16 autocast (ceiling: a bf16 matmul) and report its logprobs' "
                         "Pearson against the fp32 sampler's")
    args = ap.parse_args()

    seq_len = args.prompt + args.completion

    def model() -> transformers.PreTrainedModel:
        if args.model is not None:
            return load_model(args.model.expanduser())[0].train()
        return build(args.vocab, args.hidden, args.layers, seq_len)

    base = model()
    args.vocab = int(base.config.vocab_size)
    batches = make_batches(
        base,
        args.steps + args.warmup,
        args.batch,
        args.prompt,
        args.completion,
        args.vocab,
        shared=args.shared_prefix,
    )
    flops_per_batch = train_flops(base, args.batch, seq_len)
    tokens_per_batch = args.batch * seq_len

    tmp = tempfile.TemporaryDirectory()
    steps: dict[str, Step | str] = {}
    if args.shared_prefix:
        steps["legorl, shared_prefix on"] = legorl_step(model(), tokens_per_batch, shared_prefix=True)
        steps["legorl, shared_prefix off"] = legorl_step(model(), tokens_per_batch, shared_prefix=False)
    else:
        steps["legorl Trainer.train_step"] = legorl_step(model(), tokens_per_batch)
    if args.model_forward:
        steps["legorl, model's own forward"] = legorl_step(
            model(), tokens_per_batch, shared_prefix=args.shared_prefix, fast_forward=False
        )
    if args.autocast:
        steps[f"legorl, {args.autocast} autocast"] = legorl_step(model(), tokens_per_batch,
                                                                 shared_prefix=args.shared_prefix, autocast=args.autocast)
    steps["TRL GRPOTrainer (loss+step)"] = trl_step(
        model(), args.batch, args.prompt, args.completion, Path(args.cache_dir), tmp.name
    )
    spent, ceilings = run_alternating(steps, batches, args.warmup)
    bf16_ceiling = max(matmul_ceiling(reps=5, dtype=torch.bfloat16) for _ in range(3)) if args.autocast else None
    tmp.cleanup()
    ceiling = max(ceilings)
    tps = {
        n: step if isinstance(step, str) else args.steps * tokens_per_batch / spent[n]
        for n, step in steps.items()
    }

    def achieved(tps: float) -> float:
        return tps / tokens_per_batch * flops_per_batch

    shape = (f"{args.model.name} ({type(base).__name__})" if args.model is not None
             else f"Qwen3 hidden {args.hidden}, {args.layers} layers")
    print(
        f"model: {shape}, vocab {args.vocab} "
        f"({matmul_flops(base) / 1e6:.2f}M matmul params); batch {args.batch} x ({args.prompt} prompt + "
        f"{args.completion} completion) tokens{', one shared prompt per batch' if args.shared_prefix else ''}, "
        f"{args.steps} timed steps, fp32, {torch.get_num_threads()} threads, "
        f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', 'unset (libgomp spins)')}"
    )
    print(f"matmul ceiling (1024^3 fp32, best probe): {ceiling / 1e9:.1f} GFLOP/s\n")
    if args.shared_prefix:
        print("GFLOP/s counts per-sequence work: forwarding the prompt once does less, so it can pass 100%")
    print(f"{'trainer':<28} {'tokens/s':>10} {'GFLOP/s':>9} {'of ceiling':>11}")
    for name, v in tps.items():
        if isinstance(v, str):
            print(f"{name:<28} {v}")
        else:
            peak = bf16_ceiling if "autocast" in name and bf16_ceiling else ceiling
            print(f"{name:<28} {v:>10.0f} {achieved(v) / 1e9:>9.2f} {achieved(v) / peak:>11.1%}")
    if bf16_ceiling:
        r, d = bf16_pearson(base, batches)
        print(f"\nbf16 matmul ceiling: {bf16_ceiling / 1e9:.1f} GFLOP/s (the autocast row's 'of ceiling')")
        print(f"trainer under bf16 autocast vs the fp32 sampler: Pearson {r:.5f}, mean |dlogp| {d:.4f}")
    print()
    names = list(tps)
    for other in names[1:]:
        if not isinstance(tps[other], str):
            print(f"{names[0]} / {other} tokens/s: {tps[names[0]] / tps[other]:.2f}x")
    print(
        f"matmul probes: {min(ceilings) / 1e9:.1f}-{ceiling / 1e9:.1f} GFLOP/s; load average {os.getloadavg()[0]:.1f}"
    )


if __name__ == "__main__":
    main()
