"""The trainer's fused forward (train/fast_forward.py) and one-pass token logprobs compute what the
model's own forward and the autograd path compute: logits, logprobs, entropies and gradients."""

from __future__ import annotations

import functools

import pytest
import torch
import transformers
from helpers import tiny_qwen3

from legorl.engine.sampling import sampling_logprobs
from legorl.records import TrainingSequence
from legorl.train import fast_forward
from legorl.train.logprobs import LOGP_FLOOR, token_logprobs_and_entropy
from legorl.train.trainer import Trainer

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TOL = 1e-5
TEMP = 0.7


def qwen2(seed: int = 0) -> transformers.Qwen2ForCausalLM:
    """Qwen2: q/k/v biases, no q/k norm."""
    torch.manual_seed(seed)
    cfg = transformers.Qwen2Config(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    model = transformers.Qwen2ForCausalLM(cfg)
    with torch.no_grad():  # HF initialises biases to 0: make them matter
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 0.5)
    return model


def llama(seed: int = 0) -> transformers.LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=512,
    )
    return transformers.LlamaForCausalLM(cfg)


MODELS = {
    "qwen3": lambda: tiny_qwen3(0, pad_token_id=0),
    "qwen3-untied-mha": lambda: tiny_qwen3(1, num_key_value_heads=4, tie_word_embeddings=False),
    "qwen2-bias": qwen2,
    "llama": llama,
}


def padded_batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded rows of different lengths (pad id 0) and a loss mask with gaps, as collate makes."""
    g = torch.Generator().manual_seed(seed)
    lengths = [40, 23, 31, 9]
    ids = torch.zeros(len(lengths), 40, dtype=torch.long)
    attn = torch.zeros_like(ids)
    keep = torch.zeros_like(ids, dtype=torch.bool)
    for r, n in enumerate(lengths):
        ids[r, :n] = torch.randint(1, 300, (n,), generator=g)
        attn[r, :n] = 1
        keep[r, 3 : n - 1] = True
        keep[r, 10:13] = False  # a tool output inside the sequence
    return ids, attn, keep


def _logits_and_grads(model: torch.nn.Module, fn) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    logits = fn()
    g = torch.Generator().manual_seed(5)
    (torch.log_softmax(logits, -1) * torch.randn(logits.shape, generator=g)).sum().backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("name", list(MODELS))
def test_logits_and_gradients_equal_the_model_forward(name: str) -> None:
    model = MODELS[name]().float().eval()
    assert fast_forward.why_not(model) is None
    ids, attn, keep = padded_batch()

    def hf() -> torch.Tensor:
        out = model(input_ids=ids, attention_mask=attn, use_cache=False, logits_to_keep=keep)
        return out.logits.reshape(-1, out.logits.shape[-1])

    ref, ref_grads = _logits_and_grads(model, hf)
    got, got_grads = _logits_and_grads(model, lambda: fast_forward.logits_at(model, ids, keep))
    assert got.shape == ref.shape == (int(keep.sum()), model.config.vocab_size)
    assert (got - ref).abs().max() <= TOL
    assert got_grads.keys() == ref_grads.keys()
    for n in ref_grads:
        scale = max(1.0, ref_grads[n].abs().max().item())
        assert (got_grads[n] - ref_grads[n]).abs().max() <= TOL * scale, n


def test_models_it_does_not_cover_say_why() -> None:
    moe = transformers.Qwen3MoeForCausalLM(
        transformers.Qwen3MoeConfig(
            vocab_size=300,
            hidden_size=64,
            intermediate_size=128,
            moe_intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            num_experts=4,
        )
    )
    assert "qwen3_moe" in fast_forward.why_not(moe)
    model = tiny_qwen3()
    model.gradient_checkpointing_enable()
    assert "checkpointing" in fast_forward.why_not(model)
    model = tiny_qwen3()
    model.model.layers[0].mlp.register_forward_hook(lambda *a: None)
    assert "hooks" in fast_forward.why_not(model)
    model = tiny_qwen3()
    model.model.layers[1].self_attn.q_proj = torch.nn.Sequential(model.model.layers[1].self_attn.q_proj)
    assert "Linear" in fast_forward.why_not(model)
    assert "fp32" in fast_forward.why_not(tiny_qwen3().to(torch.bfloat16))


@pytest.mark.parametrize("temperature", [1.0, TEMP])
def test_one_pass_token_logprobs_equal_the_autograd_path(temperature: float) -> None:
    """Logprobs and entropies bit for bit; gradients to rounding (the same sums in another order)."""
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(64, 300, generator=g) * 6).requires_grad_()
    ids = torch.randint(0, 300, (64,), generator=g)
    weights = torch.randn(64, generator=g)
    lp, ent = token_logprobs_and_entropy(logits, ids, temperature)
    (lp * weights).sum().backward()
    got_grad, logits.grad = logits.grad.clone(), None

    logp_all = sampling_logprobs(logits, temperature)
    ref = logp_all.gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    p = logp_all.exp()
    ref_ent = -torch.where(p > 0, p * logp_all.clamp(min=LOGP_FLOOR), torch.zeros_like(p)).sum(-1)
    (ref * weights).sum().backward()
    assert torch.equal(lp, ref) and torch.equal(ent, ref_ent)
    assert not ent.requires_grad
    assert (got_grad - logits.grad).abs().max() <= 1e-6


def _sequences(model: torch.nn.Module) -> list[TrainingSequence]:
    g = torch.Generator().manual_seed(1)
    out = []
    for i in range(5):
        n = 20 + 7 * i
        ids = torch.randint(1, 300, (n,), generator=g).tolist()
        mask = [0] * 6 + [1] * (n - 6)
        mask[9:11] = [0, 0]
        lps = [0.0] + [-5.7 + 0.05 * (t % 5 - 2) if m else 0.0 for t, m in enumerate(mask[1:])]  # ~ uniform
        out.append(TrainingSequence(f"r{i // 2}", ids, mask, lps, (-1.0) ** i * (1 + i / 4)))
    return out


def _step_grads(fast: bool, **kw: object) -> tuple[dict[str, torch.Tensor], Trainer]:
    model = tiny_qwen3(0).float()
    tr = Trainer(model, temperature=TEMP, max_grad_norm=None, fast_forward=fast, **kw)
    if fast:  # the fused forward really runs: the model's own forward is never called

        @functools.wraps(model.forward)  # keeps the signature (logits_to_keep) visible
        def called(*a: object, **k: object) -> None:
            pytest.fail("the model's own forward was called")

        model.forward = called
        assert tr.ref_model is None or tr.fast_forward[id(tr.ref_model)]
    tr.optimizer.step = lambda *a, **k: None
    tr.optimizer.zero_grad = lambda *a, **k: None
    tr.train_step(_sequences(model))
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, tr


@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"micro_batch_tokens": 80, "mini_batches": 2, "ppo_epochs": 2, "kl_coef": 0.1, "entropy_coef": 0.01},
        {"top_p": 0.95, "top_k": 280, "token_mask": (0.5, 2.0), "loss_agg": "seq-mean-token-mean"},
    ],
    ids=["default", "decoupled-kl-entropy", "nucleus-rejection"],
)
def test_trainer_gradients_equal_with_and_without_the_fused_forward(kw: dict) -> None:
    fast, tr = _step_grads(True, **kw)
    slow, tr_slow = _step_grads(False, **kw)
    assert tr.fast_forward[id(tr.model)] and not tr_slow.fast_forward[id(tr_slow.model)]
    assert fast.keys() == slow.keys() and fast
    worst = max((fast[k] - slow[k]).abs().max().item() for k in fast)
    assert worst <= TOL, f"max |grad difference| {worst:.2e}"
    assert any(v.abs().max() > 1e-3 for v in fast.values())


def test_trainer_keeps_the_model_forward_where_the_fused_one_would_differ() -> None:
    tr = Trainer(tiny_qwen3(), autocast="bf16")
    assert not tr.fast_forward[id(tr.model)]
    tr = Trainer(tiny_qwen3(), gradient_checkpointing=True)
    assert not tr.fast_forward[id(tr.model)]
