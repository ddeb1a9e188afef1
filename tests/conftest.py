"""Shared fixtures: the built-in tokenizer and a tiny model, built on the spot (no hub)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from backends import box_cfg, docker_box_cfg  # noqa: F401 - the sandbox backend fixtures (tests/backends.py)
from vllm_real import real_vllm  # noqa: F401 - a real vLLM server for the session (tests/vllm_real.py)

# One cache for the whole test session: the tokenizer and model builds are deterministic.
CACHE = Path(os.environ.get("LEGORL_TEST_CACHE", Path(__file__).resolve().parents[1] / ".pytest_cache" / "legorl"))


@pytest.fixture(scope="session")
def cache_dir() -> Path:
    CACHE.mkdir(parents=True, exist_ok=True)
    return CACHE


@pytest.fixture(scope="session")
def tokenizer(cache_dir):
    from legorl.models import build_tokenizer

    return build_tokenizer(cache_dir, 4096)


@pytest.fixture(scope="session")
def tiny_spec():
    from legorl.models import ModelSpec

    return ModelSpec(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128, head_dim=16)


@pytest.fixture(scope="session")
def tok(tokenizer):
    """The built-in tokenizer under the short name the engine tests use."""
    return tokenizer


@pytest.fixture(scope="module")
def one_torch_thread():
    """One torch thread for a module: OpenMP threads spin-wait, and on a shared 2-core box that turns
    a 0.5 s engine test into 40 s. Modules opt in with `pytestmark = usefixtures("one_torch_thread")`."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
