"""The policy-gradient / SFT trainer (one process by default; FSDP2 across ranks under torchrun).

One ``train_step`` = one batch of rollouts = ``ppo_epochs x mini_batches`` optimizer steps.

- **Three policies.** With a single update and no rejection, the old policy is the current one
  detached (one forward per micro-batch). Otherwise ("decoupled"), an old-logprob pass runs
  first with no grad over the same micro-batches; the PPO ratio is cur/old and the IS weight
  old/rollout, so a multi-update step never mistakes old for rollout.
- **Loss** (``loss``): ``ppo`` clips each token's ratio cur/old; ``gspo`` clips each sequence's
  geometric-mean ratio, with its own clip range (losses.gspo_ratio; docs/training.md, "GSPO").
- **Normalisation** (docs/design.md, "Per-rollout loss normalisation"). ``loss_agg``: ``token-mean``
  (default; every kept token of the mini-batch weighs the same; a rollout split into several
  sequences keeps its weight because each sampled token lives in exactly one sequence),
  ``seq-mean-token-mean`` (each rollout weighs the same; ``rollout-mean`` is an alias),
  ``seq-mean-token-sum`` (sum per rollout, mean over rollouts). Weights are fixed per sequence
  before the first micro-batch, from the tokens left after IS rejection, so rejected tokens leave
  numerator and denominator and gradient accumulation equals the full-batch gradient.
- **Routing replay** (MoE): ``off``; ``R3`` replays the sampler's recorded experts
  (TrainingSequence.routed_experts); ``R2`` replays the experts the trainer itself chose in the
  old-logprob pass (so an update cannot flip routes under PPO). Under R3 with several updates,
  positions without a recorded route are replayed from the old pass too.
- **Shared prefix** (``shared_prefix``): sequences of a mini-batch sharing a long first prompt
  forward it once per micro-batch (train/prefix.py); every forward (old, update, reference, SFT)
  goes through ``_logprobs`` with the micro-batch's groups, so all passes see the same function.
"""

from __future__ import annotations

import contextlib
import copy
import math
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from legorl.config import SamplingConfig, TrainerConfig
from legorl.models.routing import (
    ReplayStats,
    RoutingRecorder,
    record_routing,
    replay_routing,
    routing_shape,
)
from legorl.records import TrainingSequence
from legorl.train import distributed as dist
from legorl.train import fast_forward as fastfwd
from legorl.train import prefix as shared
from legorl.train.batching import Micro, collate, mini_batches, plan_micro_batches
from legorl.train.losses import (
    ISCorrection,
    PolicyTerms,
    gspo_metrics,
    is_correction,
    k3,
    policy_terms,
    sequence_weights,
)
from legorl.train.metrics import mean, mismatch_metrics
from legorl.train.schedule import LRSchedule

STATE_FILE = "trainer_state.pt"
REFERENCE_DIR = "reference"
SAMPLING_KEYS = ("temperature", "top_p", "top_k")  # the sampling settings a logprob depends on


class Trainer:
    """Policy-gradient and SFT updates of ``model``.

    Its settings have one set of defaults, the config's: ``config`` is the ``trainer`` section
    (default ``TrainerConfig()``) and ``sampling`` the ``sampling`` section, whose temperature,
    top-p and top-k the logprobs must share with the engine (greedy sampling, temperature 0, is
    scored at temperature 1). Keyword ``settings`` override single keys of either, validated as
    the YAML is: ``Trainer(model, cfg.trainer, sampling=cfg.sampling)`` in a run,
    ``Trainer(model, lr=1e-3, temperature=0.7)`` in a notebook.

    The other arguments are not settings: ``total_steps`` (the run's RL steps: the cosine
    schedule's length), ``pad_id`` (the tokenizer's), ``device`` (default: the model's),
    ``ref_model`` (the KL reference; default a frozen copy of the initial weights when
    ``kl_coef`` > 0), ``fsdp`` (shard with FSDP2: "auto" under torchrun), Adam's ``betas``,
    ``shared_prefix_min`` (the shortest first prompt worth sharing, train/prefix.py) and
    ``fast_forward`` (False: always call the model's own forward; see train/fast_forward.py).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        config: TrainerConfig | None = None,
        *,
        sampling: SamplingConfig | None = None,
        total_steps: int | None = None,
        pad_id: int = 0,
        device: str | torch.device | None = None,
        ref_model: torch.nn.Module | None = None,
        fsdp: bool | str = "auto",
        betas: tuple[float, float] = (0.9, 0.999),
        shared_prefix_min: int = shared.MIN_SHARED_PREFIX,
        fast_forward: bool = True,
        **settings: Any,
    ) -> None:
        c, s = _settings(config, sampling, settings)
        self.config = c
        self.device = torch.device(device) if device is not None else next(model.parameters()).device
        self.model = model.to(self.device)
        self.route_shape = routing_shape(model)
        if c.routing_replay != "off" and self.route_shape is None:
            raise ValueError(
                f"routing_replay={c.routing_replay!r} needs an MoE model with top-k routers; "
                f"{type(model).__name__} has none (set routing_replay: off)"
            )
        # Dropout off: trainer logprobs must be the same function the sampler evaluated.
        self.model.eval()
        if c.gradient_checkpointing:
            dist.enable_gradient_checkpointing(self.model)
        # The KL reference: a frozen copy of the initial weights unless one is given.
        self.ref_model = ref_model
        if self.ref_model is None and c.kl_coef > 0:
            self.ref_model = copy.deepcopy(self.model)
        if self.ref_model is not None:
            self.ref_model.to(self.device).eval().requires_grad_(False)
        self.autocast_dtype = c.autocast
        sharded = dist.fsdp_wanted(fsdp)
        if sharded:
            dist.shard_fsdp2(self.model, mixed_precision=c.autocast)
        # Fallbacks to per-sequence forwards (train/prefix.py): routing replay forces routes per
        # padded position of whole sequences; FSDP's root unit would be bypassed by the prefix
        # forward; HF drops the KV cache under gradient checkpointing; a non-HF model has no cache.
        self.shared_prefix = (
            c.shared_prefix
            and c.routing_replay == "off"
            and not sharded
            and not c.gradient_checkpointing
            and shared.supports(self.model)
        )
        self.shared_prefix_min = shared_prefix_min
        # The fused forward (train/fast_forward.py) where it computes the same function: not under
        # autocast or routing replay, and only for models it covers (why_not says why not).
        fast_ok = fast_forward and not sharded and c.autocast is None and c.routing_replay == "off"
        self.fast_forward = {
            id(m): fast_ok and fastfwd.why_not(m) is None
            for m in (self.model, self.ref_model)
            if m is not None
        }
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.base_lr = c.lr
        # fused: one kernel per parameter instead of about ten elementwise ops (same update to 1 ulp)
        fused = not sharded and self.device.type in ("cpu", "cuda")
        self.optimizer = torch.optim.AdamW(
            self.params, lr=c.lr, betas=betas, weight_decay=c.weight_decay, fused=fused or None
        )
        self.schedule = LRSchedule(c.lr_schedule, c.warmup_steps, total_steps, c.min_lr_ratio)
        self.max_grad_norm = c.max_grad_norm
        # Must equal the engine's sampling settings: logprobs are of the distribution sampled from.
        self.temperature, self.top_p, self.top_k = s.temperature or 1.0, s.top_p, s.top_k
        self.loss = c.loss
        # Each loss clips its own ratio with its own range (a sequence ratio moves far less than a token's).
        gspo = c.loss == "gspo"
        self.clip_low = c.gspo_clip_low if gspo else c.clip_low
        self.clip_high = c.gspo_clip_high if gspo else c.clip_high
        self.tis_cap = c.tis_cap
        self.is_mode, self.token_mask, self.seq_mask = c.is_mode, c.token_mask, c.seq_mask
        self.kl_coef, self.entropy_coef = c.kl_coef, c.entropy_coef
        self.ppo_epochs, self.mini_batches = c.ppo_epochs, c.mini_batches
        self.routing_replay = c.routing_replay
        self.micro_batch_tokens = c.micro_batch_tokens
        self.pad_id = pad_id
        self.loss_agg = c.loss_agg
        self.step = 0  # optimizer steps taken (policy updates + SFT steps)
        self.policy_updates = 0  # policy optimizer steps: the lr schedule's clock

    # ---- the steps ---------------------------------------------------------------------------

    def train_step(self, sequences: list[TrainingSequence]) -> dict[str, float]:
        """Policy-gradient update(s) on a batch of sequences; returns metrics (all floats).

        ``ppo_epochs`` passes over ``mini_batches`` mini-batches, one optimizer step each, the
        gradient accumulated over the mini-batch's micro-batches. Mismatch metrics compare the
        sampler's logprobs with the trainer's before any update.
        """
        n_loss = sum(sum(s.loss_mask[1:]) for s in sequences)
        signal = any(s.advantage != 0.0 for s in sequences) or self.kl_coef or self.entropy_coef
        skip = n_loss == 0 or not signal
        minis = mini_batches(sequences, self.mini_batches)
        n_updates = self.ppo_epochs * len(minis)
        st = _Step(decoupled=n_updates > 1 or self._rejects())
        # Without a KL or entropy term a zero-advantage sequence's gradient is exactly 0 (its
        # surrogate is ratio * 0): in the one-update case it counts in the loss's mean but is never
        # forwarded. Under reinforce that is every failed rollout, most of a step. (Not when sharded:
        # every rank must run the same forwards.)
        keep_all = st.decoupled or skip or self.kl_coef or self.entropy_coef or dist.is_sharded(self.model)
        unforwarded = set() if keep_all else {i for i, s in enumerate(sequences) if s.advantage == 0.0}
        plan = [self._micro_plan(sequences, [i for i in idx if i not in unforwarded]) for idx in minis]
        if st.decoupled or skip:  # old logprobs and IS corrections, before any update
            for micros in plan:
                for mb in micros:
                    self._old_pass(mb, st)
        weights = self._weights(sequences, minis, plan, st if (st.decoupled or skip) else None)
        if skip:
            self.optimizer.zero_grad(set_to_none=True)
            metrics = {"train/loss": 0.0, "train/grad_norm": 0.0, "train/skipped": 1.0, "train/updates": 0.0}
            return {**metrics, **self._step_metrics(sequences, st, n_loss)}

        loss_total, grad_norms = 0.0, []
        for _epoch in range(self.ppo_epochs):
            for micros in plan:  # one optimizer step per mini-batch
                self.optimizer.zero_grad(set_to_none=True)
                for j, mb in enumerate(micros):  # gradient accumulation over its micro-batches
                    routes = self._forward_routes(mb, st.decoupled)
                    stats = ReplayStats()
                    last = j == len(micros) - 1
                    replay = self._routing(self.model, routes, None, stats)
                    with dist.no_sync_if_sharded(self.model, last), replay:
                        cur, ent = self._logprobs(self.model, mb, entropy_grad=bool(self.entropy_coef))
                        old, corr, ref = self._old_policy(mb, cur, ent, routes, st)
                        terms = policy_terms(
                            cur,
                            old,
                            mb.rollout_logp,
                            mb.advantages,
                            self.clip_low,
                            self.clip_high,
                            correction=corr,
                            ref_logp=ref,
                            kl_coef=self.kl_coef,
                            entropy=ent,
                            entropy_coef=self.entropy_coef,
                            loss=self.loss,
                        )
                        w = torch.tensor([weights[i] for i in mb.index], device=self.device)
                        kept = torch.where(terms.keep, terms.token_loss, torch.zeros_like(terms.token_loss))
                        loss = (kept * w.unsqueeze(-1)).sum()
                        loss.backward()  # inside the replay context: recomputation replays the same routes
                    st.gather_update(mb, stats, old, cur, terms)
                    loss_total += float(loss.detach())
                grad_norm = self._clip_grads(self.max_grad_norm)
                if math.isfinite(grad_norm):  # a non-finite norm skips the step: the weights stay sane
                    self._set_lr(self.base_lr * self.schedule.factor(self.policy_updates))
                    self.optimizer.step()
                    self.step += 1
                    self.policy_updates += 1
                self.optimizer.zero_grad(set_to_none=True)
                grad_norms.append(grad_norm)

        finite = [g for g in grad_norms if math.isfinite(g)]
        n_ok = len(finite)
        metrics = {
            "train/loss": loss_total / n_updates,
            "train/grad_norm": sum(finite) / n_ok if n_ok else grad_norms[0],  # mean over the step's updates
            "train/grad_norm_max": max(grad_norms),
            "train/skipped": 0.0 if n_ok else 1.0,
            "train/nonfinite_grad": float(n_updates - n_ok),
            "train/updates": float(n_ok),
            "train/zero_advantage_skipped": float(len(unforwarded)),
        }
        return {**metrics, **self._step_metrics(sequences, st, n_loss)}

    def sft_step(self, sequences: list[TrainingSequence], *, max_grad_norm: float | None) -> dict[str, float]:
        """One supervised step: cross-entropy (temperature 1) on mask-1 tokens, token-mean.

        The optimizer's lr is left as the caller set it (the pipeline's SFT schedule). ``max_grad_norm`` is SFT's own
        cap (``sft.max_grad_norm``; None: none): the trainer's ``max_grad_norm`` caps RL updates, whose gradients can
        be ~100x smaller than a warm start's."""
        n_loss = sum(sum(s.loss_mask[1:]) for s in sequences)
        if n_loss == 0:
            return {"sft/loss": 0.0, "sft/grad_norm": 0.0, "sft/tokens": 0.0, "sft/skipped": 1.0}
        self.optimizer.zero_grad(set_to_none=True)
        loss_total = 0.0
        micros = self._micro_plan(sequences, list(range(len(sequences))), routes=False)  # SFT never replays
        for j, mb in enumerate(micros):
            with dist.no_sync_if_sharded(self.model, j == len(micros) - 1):
                logp, _ = self._logprobs(self.model, mb, plain=True)
            loss = -torch.where(mb.mask, logp, torch.zeros_like(logp)).sum() / n_loss
            loss.backward()
            loss_total += float(loss.detach())
        grad_norm = self._clip_grads(max_grad_norm)
        ok = math.isfinite(grad_norm)
        if ok:
            self.optimizer.step()
            self.step += 1
        self.optimizer.zero_grad(set_to_none=True)
        return {
            "sft/loss": loss_total,
            "sft/grad_norm": grad_norm,
            "sft/tokens": float(n_loss),
            "sft/skipped": 0.0 if ok else 1.0,
            "sft/step": float(self.step),
        }

    # ---- what the steps use ------------------------------------------------------------------

    @property
    def _agg(self) -> str:
        return "seq-mean-token-mean" if self.loss_agg == "rollout-mean" else self.loss_agg

    def _clip_grads(self, max_norm: float | None) -> float:
        """``clip_grad_norm_``'s total norm and clipping at ``max_norm`` (None: none), without multiplying every
        gradient by a coefficient of exactly 1.0 when the norm is already within bounds (the usual case)."""
        limit = max_norm or float("inf")
        if dist.is_sharded(self.model):
            return float(torch.nn.utils.clip_grad_norm_(self.params, limit))
        grads = [p.grad for p in self.params if p.grad is not None]
        total = torch.nn.utils.get_total_norm(grads)
        norm = float(total)
        if norm + 1e-6 > limit:  # clip_grads_with_norm_'s coefficient would be below 1
            torch.nn.utils.clip_grads_with_norm_(self.params, limit, total)
        return norm

    def reset_reference(self) -> None:
        """Make the KL reference the policy's current weights (after a warm start: RL's KL then
        anchors to what SFT taught, not to the weights the run started from)."""
        if self.ref_model is not None:
            dist.load_full_model_state_dict(self.ref_model, dist.full_model_state_dict(self.model))

    def _set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def _rejects(self) -> bool:
        return self.token_mask is not None or self.seq_mask is not None or self.is_mode in ("mis", "seq-mis")

    def _micro_plan(
        self, seqs: list[TrainingSequence], indices: list[int], routes: bool = True
    ) -> list[Micro]:
        """The micro-batches of one mini-batch, with their shared-prefix groups when enabled."""
        groups = shared.find_groups(seqs, indices, self.shared_prefix_min) if self.shared_prefix else []
        shape = self.route_shape if routes else None
        return [
            collate(seqs, idx, self.pad_id, self.device, shape, groups=g)
            for idx, g in plan_micro_batches(seqs, indices, self.micro_batch_tokens, groups)
        ]

    def _logprobs(
        self, model: torch.nn.Module, mb: Micro, entropy_grad: bool = False, plain: bool = False
    ) -> tuple[Tensor, Tensor]:
        """Trainer logprobs/entropy at mb's loss positions (0 elsewhere: no vocab-sized work there).

        The one forward of every pass; mb.groups (empty: per-sequence) share their prefixes.
        ``plain``: the model's own distribution (temperature 1, no top-k/top-p), for SFT.
        """
        sampling = (1.0, 1.0, 0) if plain else (self.temperature, self.top_p, self.top_k)
        with dist.autocast(self.device, self.autocast_dtype):
            return shared.shared_logprobs(
                model,
                mb.input_ids,
                mb.attention_mask,
                mb.mask,
                mb.groups,
                sampling[0],
                sampling[1],
                entropy_grad=entropy_grad,
                top_k=sampling[2],
                fast=self.fast_forward.get(id(model), False),
            )

    def _forward_routes(self, mb: Micro, decoupled_update: bool) -> Tensor | None:
        """Routes to force in a forward over ``mb`` (None: route freely)."""
        if self.routing_replay == "off":
            return None
        if decoupled_update and "routes_used" in mb.cache:
            return mb.cache["routes_used"]  # R2, or R3 completed with the old pass's own routes
        return mb.routes if self.routing_replay == "R3" else None

    @contextlib.contextmanager
    def _routing(
        self,
        model: torch.nn.Module,
        routes: Tensor | None,
        record: RoutingRecorder | None,
        stats: ReplayStats,
    ) -> Iterator[None]:
        """Force ``routes`` (when given) and record the routes used (when asked) in forwards inside."""
        if routes is not None:
            with replay_routing(model, routes, record=record, stats=stats):
                yield
        elif record is not None:
            with record_routing(model, record):
                yield
        else:
            yield

    def _old_pass(self, mb: Micro, st: _Step) -> None:
        """No-grad forward before any update: old logprobs, entropy, the routes the trainer used,
        reference logprobs, the IS correction; gathered into ``st``."""
        stats = ReplayStats()
        record = RoutingRecorder(self.route_shape[0]) if self.routing_replay != "off" else None
        assert self.route_shape is not None or record is None
        routes = mb.routes if self.routing_replay == "R3" else None
        with torch.no_grad():
            with self._routing(self.model, routes, record, stats):
                old, ent = self._logprobs(self.model, mb)
            mb.cache["old_logp"], mb.cache["entropy"] = old, ent
            if record is not None:
                used = record.pop().to(self.device)
                pad = (mb.attention_mask == 0)[:, :, None, None]
                mb.cache["routes_used"] = used.masked_fill(pad, -1)  # padding: the sentinel, never replayed
            if self.ref_model is not None:
                mb.cache["ref_logp"] = self._ref_logprobs(mb, mb.cache.get("routes_used", routes))
        st.first_sight.add(stats, mb)
        corr = st.corrections[id(mb)] = self._correction(old, mb)
        st.gather_old(mb, old, ent, corr, mb.cache.get("ref_logp"))

    def _old_policy(
        self, mb: Micro, cur: Tensor, ent: Tensor, routes: Tensor | None, st: _Step
    ) -> tuple[Tensor, ISCorrection, Tensor | None]:
        """Old logprobs, IS correction and reference logprobs for an update over ``mb``: from the
        old pass when decoupled, else the current policy detached (gathered as the old one)."""
        if st.decoupled:
            return mb.cache["old_logp"], st.corrections[id(mb)], mb.cache.get("ref_logp")
        old, corr = cur.detach(), self._correction(cur.detach(), mb)
        ref = self._ref_logprobs(mb, routes) if self.ref_model is not None else None
        st.gather_old(mb, old, ent, corr, ref)
        return old, corr, ref

    def _ref_logprobs(self, mb: Micro, routes: Tensor | None) -> Tensor:
        assert self.ref_model is not None
        with torch.no_grad(), self._routing(self.ref_model, routes, None, ReplayStats()):
            ref, _ = self._logprobs(self.ref_model, mb)
        return ref

    def _correction(self, old: Tensor, mb: Micro) -> ISCorrection:
        return is_correction(
            old, mb.rollout_logp, mb.mask, self.is_mode, self.tis_cap, self.token_mask, self.seq_mask
        )

    def _sequence_weights(self, seqs: list[TrainingSequence], counts: list[int] | None = None) -> list[float]:
        """Per-sequence token weight so that sum(weight * kept token loss) is the (mini-)batch loss."""
        if counts is None:
            counts = [sum(s.loss_mask[1:]) for s in seqs]
        return sequence_weights(counts, [s.rollout_id for s in seqs], self._agg)

    def _weights(
        self, seqs: list[TrainingSequence], minis: list[list[int]], plan: list[list[Micro]], st: _Step | None
    ) -> list[float]:
        """Per-sequence loss weights per mini-batch (every sequence of it, forwarded or not); from the
        kept (not rejected) tokens when known (then ``plan`` forwarded every sequence)."""
        kept = None if st is None else {
            i: int(st.corrections[id(mb)].keep[r].sum()) for micros in plan for mb in micros
            for r, i in enumerate(mb.index)
        }
        weights = [0.0] * len(seqs)
        for idx in minis:
            counts = None if kept is None else [kept[i] for i in idx]
            for i, w in zip(idx, self._sequence_weights([seqs[i] for i in idx], counts)):
                weights[i] = w
        return weights

    def _step_metrics(self, sequences: list[TrainingSequence], st: _Step, n_loss: int) -> dict[str, float]:
        cat = {k: torch.cat(v) if v else torch.zeros(0) for k, v in {**st.old, **st.upd}.items()}
        metrics = mismatch_metrics(cat["old"], cat["roll"], cat["w"])
        total_tokens = sum(len(s.token_ids) for s in sequences)
        metrics.update(
            {
                "train/ppo_kl": mean(cat["ppo_kl"]),
                "train/clip_frac": mean(cat["clipped"]),
                "train/ratio_mean": mean(cat["ratio"], default=1.0),
                "train/is_truncated_frac": mean(cat["trunc"]),
                "train/is_rejected_frac": 1.0 - mean(cat["kept"], default=1.0),
                "train/entropy": mean(cat["ent"]),
                "train/tokens": float(total_tokens),
                "train/loss_tokens": float(n_loss),
                "train/masked_frac": 1.0 - n_loss / total_tokens if total_tokens else 0.0,
                "train/sequences": float(len(sequences)),
                "train/rollouts": float(len({s.rollout_id for s in sequences})),
                "train/lr": float(self.optimizer.param_groups[0]["lr"]),
                "train/step": float(self.step),
            }
        )
        if self.ref_model is not None:
            metrics["train/kl_ref"] = mean(cat["kl_ref"])
        if self.loss == "gspo":  # per sequence and update, each sequence counted once
            seq = gspo_metrics(cat["seq_ratio"], cat["seq_clipped"].bool())
            metrics.update({f"train/{k}": v for k, v in seq.items()})
        if self.routing_replay != "off":
            # Differences: the first forward that replayed (sampler vs trainer under R3; for R2, the
            # updated trainer vs its own old routes). Replayed fraction: tokens forced in the updates.
            diff = st.first_sight if st.first_sight.replayed else st.update_sight
            metrics["train/routing_replayed_frac"] = st.update_sight.replayed_tokens_frac()
            metrics["train/routing_diff_frac"] = diff.differing / diff.replayed if diff.replayed else 0.0
            metrics["train/routing_token_diff_frac"] = (
                diff.tokens_differing / diff.tokens if diff.tokens else 0.0
            )
        return metrics

    # ---- weights and checkpoints ------------------------------------------------------------

    def state_dict_for_engine(self) -> dict[str, Tensor]:
        """Detached full copies of the weights, safe to hand to an engine while training continues."""
        return dist.full_model_state_dict(self.model)

    def save(self, directory: str | Path) -> None:
        """Model via save_pretrained (safetensors, loads with AutoModelForCausalLM.from_pretrained),
        optimizer, lr schedule, step counters and RNG states in trainer_state.pt, and the frozen
        KL reference (when any) under reference/. Under FSDP every rank gathers, rank 0 writes."""
        d = Path(directory)
        full = dist.full_model_state_dict(self.model) if dist.is_sharded(self.model) else None
        optim = dist.full_optimizer_state_dict(self.model, self.optimizer)
        if not dist.is_main_process():
            return
        d.mkdir(parents=True, exist_ok=True)
        if full is not None:
            self.model.save_pretrained(d, state_dict=full)
        else:
            self.model.save_pretrained(d)
        if self.ref_model is not None and hasattr(self.ref_model, "save_pretrained"):
            self.ref_model.save_pretrained(d / REFERENCE_DIR)
        state = {
            "optimizer": optim,
            "step": self.step,
            "policy_updates": self.policy_updates,
            "schedule": self.schedule.to_dict(),
            "base_lr": self.base_lr,
            "torch_rng": torch.get_rng_state(),
            "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
            "python_rng": random.getstate(),
            "numpy_rng": _numpy_rng_state(),
        }
        torch.save(state, d / STATE_FILE)

    def load(self, directory: str | Path, reference: str | Path | None = None) -> None:
        """Restore a checkpoint. The KL reference comes from its ``reference/``; a checkpoint saved
        without one (``kl_coef`` was 0 then) takes it from ``reference``, a model directory (the SFT
        warm start), else the reference stays the weights this trainer was built with."""
        d = Path(directory)
        _load_safetensors_into(self.model, d)
        if self.ref_model is not None and (d / REFERENCE_DIR).is_dir():
            _load_safetensors_into(self.ref_model, d / REFERENCE_DIR)
        elif self.ref_model is not None and reference is not None:
            _load_safetensors_into(self.ref_model, Path(reference))
        state = torch.load(d / STATE_FILE, map_location="cpu", weights_only=True)
        dist.load_full_optimizer_state_dict(self.model, self.optimizer, state["optimizer"])
        self.step = int(state["step"])
        self.policy_updates = int(state.get("policy_updates", 0))
        if "schedule" in state:
            self.schedule = LRSchedule(**state["schedule"])
            self.base_lr = float(state["base_lr"])
        torch.set_rng_state(state["torch_rng"].cpu())
        if state["cuda_rng"] and torch.cuda.is_available():
            torch.cuda.set_rng_state_all([s.cpu() for s in state["cuda_rng"]])
        random.setstate(state["python_rng"])
        if "numpy_rng" in state:
            _set_numpy_rng_state(state["numpy_rng"])


class _Step:
    """What one train_step gathers: IS corrections per micro-batch, metric tensors, route stats."""

    def __init__(self, decoupled: bool) -> None:
        self.decoupled = decoupled
        self.corrections: dict[int, ISCorrection] = {}
        self.old: dict[str, list[Tensor]] = {
            k: [] for k in ("old", "roll", "ent", "w", "trunc", "kept", "kl_ref")
        }
        self.upd: dict[str, list[Tensor]] = {
            k: [] for k in ("ppo_kl", "clipped", "ratio", "seq_ratio", "seq_clipped")
        }
        self.first_sight, self.update_sight = _RouteAcc(), _RouteAcc()

    def gather_old(self, mb: Micro, old: Tensor, ent: Tensor, corr: ISCorrection, ref: Tensor | None) -> None:
        """Before-update quantities on loss tokens (mismatch metrics, IS weights on kept tokens)."""
        m, g = mb.mask, self.old
        g["old"].append(old.detach()[m])
        g["roll"].append(mb.rollout_logp[m])
        g["ent"].append(ent.detach()[m])
        g["w"].append(corr.weight[corr.keep])
        g["trunc"].append(corr.truncated[corr.keep].float())
        g["kept"].append(corr.keep[m].float())
        if ref is not None:
            g["kl_ref"].append(k3(old.detach(), ref)[corr.keep])

    def gather_update(self, mb: Micro, stats: ReplayStats, old: Tensor, cur: Tensor, terms: PolicyTerms) -> None:
        """An update's routes and its PPO quantities on kept tokens."""
        self.update_sight.add(stats, mb)
        if not self.decoupled:  # the update was the first forward
            self.first_sight.add(stats, mb)
        k = terms.keep
        self.upd["ppo_kl"].append(k3(old.detach(), cur.detach())[k])
        self.upd["clipped"].append(terms.clipped[k].float())
        self.upd["ratio"].append(terms.ratio[k])
        if terms.seq_ratio is not None:
            ratio, clipped = terms.seq_clip()
            self.upd["seq_ratio"].append(ratio)
            self.upd["seq_clipped"].append(clipped.float())


class _RouteAcc:
    """Sums ReplayStats over forwards; token fractions are over real (non-padding) tokens."""

    def __init__(self) -> None:
        self.replayed = self.differing = self.tokens = self.tokens_differing = self.real_tokens = 0

    def add(self, st: ReplayStats, mb: Micro) -> None:
        self.replayed += st.replayed
        self.differing += st.differing
        self.tokens += st.tokens
        self.tokens_differing += st.tokens_differing
        self.real_tokens += int(mb.attention_mask.sum())

    def replayed_tokens_frac(self) -> float:
        return self.tokens / self.real_tokens if self.real_tokens else 0.0


def _numpy_rng_state() -> tuple:
    """numpy's global RNG state with the key array as a tensor (checkpoints load with weights_only)."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    return (kind, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached))


def _set_numpy_rng_state(state: tuple) -> None:
    kind, keys, pos, has_gauss, cached = state
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))


def _load_safetensors_into(model: torch.nn.Module, directory: Path) -> None:
    """Load every *.safetensors shard; keys only missing because they are tied are fine."""
    from safetensors.torch import load_file

    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {directory}; was it written by Trainer.save?")
    loaded: dict[str, Tensor] = {}
    for f in files:
        loaded.update(load_file(str(f)))
    if dist.is_sharded(model):
        dist.load_full_model_state_dict(model, loaded)
        return
    result = model.load_state_dict(loaded, strict=False)
    own = model.state_dict()
    ptrs = {own[k].data_ptr() for k in loaded if k in own}
    missing = [k for k in result.missing_keys if own[k].data_ptr() not in ptrs]
    if missing or result.unexpected_keys:
        raise ValueError(
            f"checkpoint {directory} does not match the model: missing {missing[:5]}, "
            f"unexpected {result.unexpected_keys[:5]}"
        )


def _settings(
    config: TrainerConfig | None, sampling: SamplingConfig | None, overrides: dict[str, Any]
) -> tuple[TrainerConfig, SamplingConfig]:
    """The trainer and sampling sections with single keys overridden, validated like a config file."""
    unknown = set(overrides) - set(TrainerConfig.model_fields) - set(SAMPLING_KEYS)
    if unknown:
        raise TypeError(f"Trainer() got unexpected keyword arguments {sorted(unknown)}: neither "
                        f"trainer settings (TrainerConfig) nor sampling keys {SAMPLING_KEYS}")
    c, s = config or TrainerConfig(), sampling or SamplingConfig()
    c_over = {k: v for k, v in overrides.items() if k not in SAMPLING_KEYS}
    s_over = {k: v for k, v in overrides.items() if k in SAMPLING_KEYS}
    if c_over:
        c = TrainerConfig.model_validate({**c.model_dump(), **c_over})
    if s_over:
        s = SamplingConfig.model_validate({**s.model_dump(), **s_over})
    return c, s
