"""A real vLLM server for the tests (tests/test_engine_vllm_real.py): one per test session.

It serves a tiny random Qwen3 built on the spot (fp32, no eos: completions end only on the stops a
test asks for or at max_tokens) through legorl's launcher (legorl.engine.vllm_server), with
``--enforce-eager`` (starts in seconds instead of a minute of torch.compile). vLLM's environment is
``.venv/vllm`` (``make setup-test``) or ``LEGORL_VLLM_PYTHON``; where there is none the tests skip with
the reason, except under ``LEGORL_REQUIRE_VLLM=1`` (``make test``), where they fail.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from legorl.engine.vllm_server import VLLMServer, VLLMServerConfig, vllm_python, vllm_server

REQUIRED = os.environ.get("LEGORL_REQUIRE_VLLM") == "1"
MAX_MODEL_LEN = 256


@dataclasses.dataclass
class RealVLLM:
    server: VLLMServer
    model_dir: Path  # the served checkpoint (start-up weights)
    work: Path  # scratch space: checkpoints for reloads
    start_s: float  # launch to /health answering

    @property
    def url(self) -> str:
        return self.server.url


def write_tiny_checkpoint(tokenizer, path: Path, seed: int):
    """A tiny Qwen3 saved at ``path`` without eos ids (so vLLM stops only where a test says); the model."""
    from legorl.models import ModelSpec, build_model, save_model

    model = build_model(ModelSpec(seed=seed, max_position_embeddings=MAX_MODEL_LEN), tokenizer)
    save_model(model, tokenizer, path)
    for name in ("config.json", "generation_config.json"):
        data = json.loads((path / name).read_text())
        data.pop("eos_token_id", None)
        (path / name).write_text(json.dumps(data, indent=2))
    return model


@pytest.fixture(scope="session")
def real_vllm(tmp_path_factory, tokenizer) -> Iterator[RealVLLM]:
    python = vllm_python()
    if python is None or not python.is_file():
        reason = ("no vLLM environment: .venv/vllm is absent (`make setup-test` builds it) and "
                  "LEGORL_VLLM_PYTHON is unset" if python is None else f"LEGORL_VLLM_PYTHON={python} does not exist")
        if REQUIRED:
            pytest.fail(f"{reason} (LEGORL_REQUIRE_VLLM=1: `make test` must test against a real vLLM)")
        pytest.skip(reason)
    work = tmp_path_factory.mktemp("vllm")
    model_dir = work / "model"
    write_tiny_checkpoint(tokenizer, model_dir, seed=5)
    cfg = VLLMServerConfig(model=model_dir, port=0, max_model_len=MAX_MODEL_LEN, enforce_eager=True)
    start = time.monotonic()
    with vllm_server(cfg, work / "server.log", python=python, ready_timeout_s=600) as server:
        yield RealVLLM(server, model_dir, work, time.monotonic() - start)
