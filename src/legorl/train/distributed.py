"""GPU / multi-device path: bf16 autocast, gradient checkpointing, FSDP2 sharding.

CPU (one process, fp32) is the tested default. FSDP2 (``torch.distributed.fsdp.fully_shard``)
is used when a process group with several ranks is initialised (``torchrun``) and the trainer
is asked for it: every decoder layer is one shard unit, then the root (embeddings and a tied
lm_head stay together in the root unit). Full (unsharded) state dicts for the engine and for
checkpoints are gathered with ``torch.distributed.checkpoint.state_dict``; rank 0 writes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import Tensor, nn

AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def world_size() -> int:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_world_size()
    return 1


def is_main_process() -> bool:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank() == 0
    return True


def fsdp_wanted(fsdp: bool | str) -> bool:
    """``fsdp``: True (require), False (never) or "auto" (when several ranks are initialised)."""
    if fsdp == "auto":
        return world_size() > 1
    if fsdp and world_size() <= 1:
        raise RuntimeError(
            "fsdp=True needs an initialised torch.distributed process group with several ranks "
            "(launch with torchrun --nproc-per-node N); use fsdp='auto' to fall back to one device"
        )
    return bool(fsdp)


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks of a HF causal LM (model.model.layers), else []."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    return list(layers) if layers is not None else []


def shard_fsdp2(model: nn.Module, mixed_precision: str | None = None) -> nn.Module:
    """Apply FSDP2 in place: each decoder layer, then the root. Returns the model."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    kw: dict[str, object] = {}
    if mixed_precision in AUTOCAST_DTYPES:
        kw["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=AUTOCAST_DTYPES[mixed_precision], reduce_dtype=torch.float32
        )
    layers = decoder_layers(model)
    if not layers:
        raise ValueError(f"{type(model).__name__} has no model.layers to shard; FSDP2 needs a HF causal LM")
    for layer in layers:
        fully_shard(layer, **kw)
    fully_shard(model, **kw)
    return model


def is_sharded(model: nn.Module) -> bool:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - old torch
        return False
    return isinstance(model, FSDPModule)


def full_model_state_dict(model: nn.Module) -> dict[str, Tensor]:
    """Unsharded, detached CPU copies of the weights (gathered across ranks when sharded)."""
    if is_sharded(model):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return {k: v.detach().clone() for k, v in get_model_state_dict(model, options=opts).items()}
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def full_optimizer_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    if is_sharded(model):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return get_optimizer_state_dict(model, optimizer, options=opts)
    return optimizer.state_dict()


def load_full_optimizer_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
    if is_sharded(model):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        opts = StateDictOptions(full_state_dict=True, broadcast_from_rank0=False)
        set_optimizer_state_dict(model, optimizer, optim_state_dict=state, options=opts)
    else:
        optimizer.load_state_dict(state)


def load_full_model_state_dict(model: nn.Module, state: dict[str, Tensor]) -> None:
    if is_sharded(model):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True, strict=False))
    else:
        model.load_state_dict(state, strict=False)


def autocast(device: torch.device, dtype: str | None) -> contextlib.AbstractContextManager:
    """torch.autocast for "bf16"/"fp16" (weights stay fp32, matmuls run low precision), else a no-op."""
    if dtype is None or dtype == "fp32":
        return contextlib.nullcontext()
    if dtype not in AUTOCAST_DTYPES:
        raise ValueError(f"unknown autocast dtype {dtype!r}; choose bf16, fp16 or None")
    return torch.autocast(device_type=device.type, dtype=AUTOCAST_DTYPES[dtype])


def enable_gradient_checkpointing(model: nn.Module) -> None:
    """Recompute activations in backward (HF non-reentrant checkpointing).

    HF only checkpoints in train mode, so the model is put in train mode; that is safe only when
    every dropout is 0 (trainer logprobs must be the function the sampler evaluated): checked here.
    """
    if not hasattr(model, "gradient_checkpointing_enable"):
        raise ValueError(f"{type(model).__name__} does not support HF gradient checkpointing")
    cfg = getattr(model, "config", None)
    for name in ("attention_dropout", "hidden_dropout", "dropout", "resid_pdrop", "embd_pdrop"):
        p = float(getattr(cfg, name, 0.0) or 0.0)
        if p > 0:
            raise ValueError(
                f"gradient checkpointing puts the model in train mode, but config.{name}={p} would then "
                "make trainer logprobs random; set it to 0"
            )
    for m in model.modules():
        if isinstance(m, nn.Dropout) and m.p > 0:
            raise ValueError(
                f"gradient checkpointing: dropout module with p={m.p} would be active in train mode"
            )
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.x name
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()


@contextlib.contextmanager
def no_sync_if_sharded(model: nn.Module, last: bool) -> Iterator[None]:
    """Skip the gradient reduce-scatter on all but the last micro-batch of an FSDP2 step."""
    if is_sharded(model):
        model.set_requires_gradient_sync(last)  # type: ignore[attr-defined]
    yield
