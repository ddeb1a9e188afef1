"""The policy-gradient / SFT trainer (one process, one device; FSDP comes later).

Normalisation choice (DESIGN.md: "per-rollout loss normalisation so splitting does not
reweight rollouts"): the default ``loss_agg="token-mean"`` divides the summed token losses
by the number of loss tokens in the whole batch. Every sampled token lives in exactly one
training sequence (a segment break re-includes history only as mask-0 prompt), so how a
rollout is split into sequences cannot change its weight; weighting by
1/n_sequences_in_rollout would, on the contrary, halve a rollout's weight the moment it
splits in two. ``loss_agg="rollout-mean"`` instead averages each rollout's tokens across
all its sequences and then averages rollouts (every rollout weighs the same, whatever
its length or number of segments).

Both are computed with per-sequence weights fixed over the whole batch before the first
micro-batch, so gradient accumulation gives exactly the full-batch gradient.
"""

from __future__ import annotations

import math
import random
from pathlib import Path

import torch
from torch import Tensor

from legorl.records import TrainingSequence
from legorl.train.logprobs import sequence_logprobs
from legorl.train.losses import policy_terms

LOSS_AGGS = ("token-mean", "rollout-mean")
STATE_FILE = "trainer_state.pt"


class Trainer:
    def __init__(
        self,
        model: torch.nn.Module,
        *,
        lr: float = 1e-5,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.999),
        max_grad_norm: float | None = 1.0,
        temperature: float = 1.0,
        top_p: float = 1.0,
        clip_low: float = 0.2,
        clip_high: float = 0.28,
        tis_cap: float | None = 2.0,
        micro_batch_tokens: int = 4096,
        pad_id: int = 0,
        loss_agg: str = "token-mean",
        device: str | torch.device | None = None,
    ) -> None:
        if loss_agg not in LOSS_AGGS:
            raise ValueError(f"unknown loss_agg {loss_agg!r}; choose one of {LOSS_AGGS}")
        self.device = torch.device(device) if device is not None else next(model.parameters()).device
        self.model = model.to(self.device)
        # Dropout off: trainer logprobs must be the same function the sampler evaluated.
        self.model.eval()
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=lr, betas=betas, weight_decay=weight_decay)
        self.max_grad_norm = max_grad_norm
        # Must equal the engine's sampling settings: logprobs are of the distribution sampled from.
        self.temperature, self.top_p = temperature, top_p
        self.clip_low, self.clip_high, self.tis_cap = clip_low, clip_high, tis_cap
        self.micro_batch_tokens = micro_batch_tokens
        self.pad_id = pad_id
        self.loss_agg = loss_agg
        self.step = 0  # optimizer steps taken (the weight version the engine will serve next)

    # ---- batching -------------------------------------------------------------------------

    def _micro_batches(self, seqs: list[TrainingSequence]) -> list[list[int]]:
        """Group sequence indices so that rows x padded length <= micro_batch_tokens.

        Sorting by length keeps padding small; a sequence longer than the budget gets its own batch.
        """
        order = sorted(range(len(seqs)), key=lambda i: -len(seqs[i].token_ids))
        batches: list[list[int]] = []
        cur: list[int] = []
        cur_max = 0
        for i in order:
            n = len(seqs[i].token_ids)
            new_max = max(cur_max, n)
            if cur and new_max * (len(cur) + 1) > self.micro_batch_tokens:
                batches.append(cur)
                cur, new_max = [], n
            cur.append(i)
            cur_max = new_max
        if cur:
            batches.append(cur)
        return batches

    def _collate(self, seqs: list[TrainingSequence]) -> dict[str, Tensor]:
        """Right-padded tensors; targets/mask/logprobs are shifted to align with logits[:, :-1]."""
        length = max(len(s.token_ids) for s in seqs)
        ids = torch.full((len(seqs), length), self.pad_id, dtype=torch.long)
        attn = torch.zeros((len(seqs), length), dtype=torch.long)
        mask = torch.zeros((len(seqs), length), dtype=torch.bool)
        rlp = torch.zeros((len(seqs), length), dtype=torch.float32)
        for row, s in enumerate(seqs):
            n = len(s.token_ids)
            if not (len(s.loss_mask) == len(s.rollout_logprobs) == n):
                raise ValueError(
                    f"sequence of rollout {s.rollout_id}: token_ids/loss_mask/rollout_logprobs lengths "
                    f"{n}/{len(s.loss_mask)}/{len(s.rollout_logprobs)} differ; rebuild it with build_sequences"
                )
            ids[row, :n] = torch.tensor(s.token_ids, dtype=torch.long)
            attn[row, :n] = 1
            mask[row, :n] = torch.tensor(s.loss_mask, dtype=torch.bool)
            rlp[row, :n] = torch.tensor(s.rollout_logprobs, dtype=torch.float32)
        dev = self.device
        return {
            "input_ids": ids.to(dev),
            "attention_mask": attn.to(dev),
            "mask": mask[:, 1:].to(dev),  # the first token is never predicted
            "rollout_logp": rlp[:, 1:].to(dev),
        }

    def _sequence_weights(self, seqs: list[TrainingSequence]) -> list[float]:
        """Per-sequence token weight so that sum(weight * token_loss) is the batch loss."""
        counts = [sum(s.loss_mask[1:]) for s in seqs]
        if self.loss_agg == "token-mean":
            total = sum(counts)
            return [1.0 / total if total else 0.0] * len(seqs)
        per_rollout: dict[str, int] = {}
        for s, c in zip(seqs, counts):
            per_rollout[s.rollout_id] = per_rollout.get(s.rollout_id, 0) + c
        n_rollouts = sum(1 for c in per_rollout.values() if c > 0)
        return [
            1.0 / (n_rollouts * per_rollout[s.rollout_id]) if per_rollout[s.rollout_id] else 0.0 for s in seqs
        ]

    def _clip_and_step(self) -> tuple[float, bool]:
        """Clip the gradient norm and step; a non-finite norm skips the step (weights stay sane)."""
        max_norm = self.max_grad_norm if self.max_grad_norm else float("inf")
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.params, max_norm))
        ok = math.isfinite(grad_norm)
        if ok:
            self.optimizer.step()
            self.step += 1
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm, ok

    # ---- steps ----------------------------------------------------------------------------

    def train_step(self, sequences: list[TrainingSequence]) -> dict[str, float]:
        """One policy-gradient update on a batch of sequences (old policy = current, detached).

        Mismatch metrics compare the sampler's logprobs with the trainer's, computed in the
        same forward pass, i.e. before the update.
        """
        n_loss = sum(sum(s.loss_mask[1:]) for s in sequences)
        skip = n_loss == 0 or all(s.advantage == 0.0 for s in sequences)
        weights = self._sequence_weights(sequences)
        self.optimizer.zero_grad(set_to_none=True)
        gathered: dict[str, list[Tensor]] = {
            k: [] for k in ("cur", "roll", "ent", "ratio", "clipped", "w", "trunc")
        }
        loss_total = 0.0
        total_tokens = 0
        for idx in self._micro_batches(sequences):
            batch = [sequences[i] for i in idx]
            t = self._collate(batch)
            total_tokens += int(t["attention_mask"].sum())
            with torch.set_grad_enabled(not skip):
                cur, ent = sequence_logprobs(
                    self.model, t["input_ids"], t["attention_mask"], self.temperature
                )
                adv = torch.tensor([s.advantage for s in batch], dtype=torch.float32, device=self.device)
                terms = policy_terms(
                    cur, None, t["rollout_logp"], adv, self.clip_low, self.clip_high, self.tis_cap
                )
                w = torch.tensor([weights[i] for i in idx], dtype=torch.float32, device=self.device)
                masked = torch.where(t["mask"], terms.token_loss, torch.zeros_like(terms.token_loss))
                loss = (masked * w.unsqueeze(-1)).sum()
            if not skip:
                loss.backward()
            loss_total += float(loss.detach())
            m = t["mask"]
            gathered["cur"].append(cur.detach()[m])
            gathered["roll"].append(t["rollout_logp"][m])
            gathered["ent"].append(ent[m])
            gathered["ratio"].append(terms.ratio[m])
            gathered["clipped"].append(terms.clipped[m].float())
            gathered["w"].append(terms.is_weight[m])
            gathered["trunc"].append(terms.truncated[m].float())

        metrics: dict[str, float] = {"train/loss": loss_total}
        if skip:
            self.optimizer.zero_grad(set_to_none=True)
            metrics.update({"train/grad_norm": 0.0, "train/skipped": 1.0})
        else:
            grad_norm, ok = self._clip_and_step()
            metrics.update({"train/grad_norm": grad_norm, "train/skipped": 0.0 if ok else 1.0})
            metrics["train/nonfinite_grad"] = 0.0 if ok else 1.0
        g = {k: torch.cat(v) if v else torch.zeros(0) for k, v in gathered.items()}
        metrics.update(_mismatch_metrics(g["cur"], g["roll"], g["w"]))
        metrics.update(
            {
                "train/clip_frac": _mean(g["clipped"]),
                "train/ratio_mean": _mean(g["ratio"], default=1.0),
                "train/is_truncated_frac": _mean(g["trunc"]),
                "train/entropy": _mean(g["ent"]),
                "train/tokens": float(total_tokens),
                "train/loss_tokens": float(n_loss),
                "train/masked_frac": 1.0 - n_loss / total_tokens if total_tokens else 0.0,
                "train/sequences": float(len(sequences)),
                "train/rollouts": float(len({s.rollout_id for s in sequences})),
                "train/step": float(self.step),
            }
        )
        return metrics

    def sft_step(self, sequences: list[TrainingSequence]) -> dict[str, float]:
        """One supervised step: cross-entropy (temperature 1) on mask-1 tokens, token-mean."""
        n_loss = sum(sum(s.loss_mask[1:]) for s in sequences)
        if n_loss == 0:
            return {"sft/loss": 0.0, "sft/grad_norm": 0.0, "sft/tokens": 0.0, "sft/skipped": 1.0}
        self.optimizer.zero_grad(set_to_none=True)
        loss_total = 0.0
        for idx in self._micro_batches(sequences):
            t = self._collate([sequences[i] for i in idx])
            logp, _ = sequence_logprobs(self.model, t["input_ids"], t["attention_mask"], 1.0)
            loss = -torch.where(t["mask"], logp, torch.zeros_like(logp)).sum() / n_loss
            loss.backward()
            loss_total += float(loss.detach())
        grad_norm, ok = self._clip_and_step()
        return {
            "sft/loss": loss_total,
            "sft/grad_norm": grad_norm,
            "sft/tokens": float(n_loss),
            "sft/skipped": 0.0 if ok else 1.0,
            "sft/step": float(self.step),
        }

    # ---- weights and checkpoints ------------------------------------------------------------

    def state_dict_for_engine(self) -> dict[str, Tensor]:
        """Detached copies of the weights, safe to hand to an engine while training continues."""
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}

    def save(self, directory: str | Path) -> None:
        """Model via save_pretrained (safetensors) + optimizer, step and RNG in trainer_state.pt."""
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        self.model.save_pretrained(d)
        state = {
            "optimizer": self.optimizer.state_dict(),
            "step": self.step,
            "torch_rng": torch.get_rng_state(),
            "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
            "python_rng": random.getstate(),
        }
        torch.save(state, d / STATE_FILE)

    def load(self, directory: str | Path) -> None:
        d = Path(directory)
        _load_safetensors_into(self.model, d)
        state = torch.load(d / STATE_FILE, map_location=self.device, weights_only=True)
        self.optimizer.load_state_dict(state["optimizer"])
        self.step = int(state["step"])
        torch.set_rng_state(state["torch_rng"].cpu())
        if state["cuda_rng"] and torch.cuda.is_available():
            torch.cuda.set_rng_state_all([s.cpu() for s in state["cuda_rng"]])
        random.setstate(state["python_rng"])


def _load_safetensors_into(model: torch.nn.Module, directory: Path) -> None:
    """Load every *.safetensors shard; keys only missing because they are tied are fine."""
    from safetensors.torch import load_file

    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {directory}; was it written by Trainer.save?")
    loaded: dict[str, Tensor] = {}
    for f in files:
        loaded.update(load_file(str(f)))
    result = model.load_state_dict(loaded, strict=False)
    own = model.state_dict()
    ptrs = {own[k].data_ptr() for k in loaded if k in own}
    missing = [k for k in result.missing_keys if own[k].data_ptr() not in ptrs]
    if missing or result.unexpected_keys:
        raise ValueError(
            f"checkpoint {directory} does not match the model: missing {missing[:5]}, "
            f"unexpected {result.unexpected_keys[:5]}"
        )


def _mean(x: Tensor, default: float = 0.0) -> float:
    return float(x.float().mean()) if x.numel() else default


def _mismatch_metrics(trainer_logp: Tensor, sampler_logp: Tensor, is_weight: Tensor) -> dict[str, float]:
    """Sampler/trainer mismatch on loss tokens (LESSONS.md: Pearson >= 0.99, |dlogp| ~ 0.01-0.03 bf16)."""
    n = trainer_logp.numel()
    if n == 0:
        return {
            "train/logprob_pearson": 1.0,
            "train/mismatch_k3_kl": 0.0,
            "train/mismatch_abs_dlogp_mean": 0.0,
            "train/mismatch_abs_dlogp_max": 0.0,
            "train/is_weight_mean": 1.0,
            "train/is_ess": 1.0,
        }
    t, s = trainer_logp.double(), sampler_logp.double()
    r = t - s  # log(trainer / sampler) on sampler samples: k3 estimates KL(sampler || trainer)
    k3 = torch.exp(r) - 1.0 - r
    pt, ps = t.exp(), s.exp()
    dt, ds = pt - pt.mean(), ps - ps.mean()
    denom = math.sqrt(float((dt * dt).sum()) * float((ds * ds).sum()))
    if denom > 0:
        pearson = float((dt * ds).sum()) / denom
    else:  # constant probabilities: perfectly matched only if identical
        pearson = 1.0 if float((pt - ps).abs().max()) < 1e-9 else 0.0
    w = is_weight.double()
    ess = float(w.sum() ** 2 / (n * (w * w).sum())) if float((w * w).sum()) > 0 else 0.0
    return {
        "train/logprob_pearson": pearson,
        "train/mismatch_k3_kl": float(k3.mean()),
        "train/mismatch_abs_dlogp_mean": float(r.abs().mean()),
        "train/mismatch_abs_dlogp_max": float(r.abs().max()),
        "train/is_weight_mean": float(w.mean()),
        "train/is_ess": ess,
    }
