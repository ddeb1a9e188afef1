"""A key the chosen backend cannot honour is refused at load, naming the key and why; never ignored."""

from __future__ import annotations

from pathlib import Path

import pytest

from legorl.config import ConfigError, load_config


@pytest.mark.parametrize("overrides, words", [
    (["sandbox.kind=lxc"], ["sandbox.kind", "bwrap", "docker", "'lxc'"]),
    (["sandbox.docker_host=unix:///run/podman/podman.sock"], ["sandbox.docker_host", "not honoured by sandbox.kind bwrap"]),
    (["sandbox.image=my/image:1"], ["sandbox.image", "not honoured by sandbox.kind bwrap"]),
    (["engine.urls=[http://gpu1:8000]"], ["engine.urls", "not honoured by engine.kind local"]),
    (["engine.checkpoint_dir=/shared"], ["engine.checkpoint_dir", "engine.kind local"]),
    (["engine.kind=vllm"], ["engine.urls is empty", "engine.serve: true"]),
    (["engine.serve=true"], ["engine.serve starts a vLLM server", "engine.kind vllm, not local"]),
    (["engine.kind=vllm", "engine.serve=true", "engine.urls=[http://gpu1:8000]"], ["leave engine.urls empty"]),
    (["engine.kind=vllm", "engine.urls=[http://gpu1:8000]", "engine.serve_eager=true"],
     ["engine.serve_eager", "set engine.serve: true"]),
    (["engine.kind=vllm", "engine.urls=[http://gpu1:8000]", "engine.max_batch=64"],
     ["engine.max_batch", "not honoured by engine.kind vllm", "embedded engine"]),
    (["engine.kind=sglang", "engine.urls=[http://gpu1:30000]", "engine.prefix_cache_mb=64"],
     ["engine.prefix_cache_mb", "engine.kind sglang"]),
    (["engine.kind=scripted", "engine.max_batch=4"], ["engine.max_batch", "engine.kind scripted"]),
    (["engine.kind=scripted", "engine.split_steps=true"], ["engine.split_steps", "engine.kind scripted"]),
    (["tasks.path=tasks.jsonl"], ["tasks.path", "built-in suite has no file"]),
    (["tasks.source=harbor"], ["tasks.source harbor needs tasks.path"]),
    (["sft.teacher_url=https://host/v1"], ["sft.teacher_url", "scripted teacher"]),
    (["sft.teacher_model=big"], ["sft.teacher_model", "scripted teacher"]),
    (["ray.workers=4"], ["ray.workers", "ray.address is null"]),
    (["ray.engine_host=10.0.0.1"], ["ray.engine_host", "ray.address is null"]),
])
def test_unhonoured_keys_are_refused(overrides: list[str], words: list[str]) -> None:
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    msg = str(e.value)
    assert "\n" not in msg
    for w in words:
        assert w in msg, msg


@pytest.mark.parametrize("key", ["n_train=4", "n_heldout=2", "seed=3", "families=[off_by_one]"])
def test_builtin_suite_keys_are_refused_for_a_task_file(tmp_path: Path, key: str) -> None:
    rows = tmp_path / "tasks.jsonl"
    rows.write_text("")
    with pytest.raises(ConfigError, match=f"tasks.{key.split('=')[0]} .*not honoured by tasks.source jsonl"):
        load_config(None, ["tasks.source=jsonl", f"tasks.path={rows}", f"tasks.{key}"])


def test_ray_only_keys_and_their_backends() -> None:
    pytest.importorskip("ray")
    cfg = load_config(None, ["ray.address=local", "ray.workers=4", "ray.engine_host=127.0.0.1"])
    assert cfg.ray.workers == 4
    with pytest.raises(ConfigError, match="ray.engine_host is not honoured by engine.kind vllm"):
        load_config(None, ["ray.address=local", "ray.engine_host=127.0.0.1", "engine.kind=vllm",
                           "engine.urls=[http://gpu1:8000]"])
    with pytest.raises(ConfigError, match="proxy.port is not honoured with ray.address"):
        load_config(None, ["ray.address=local", "proxy.port=8000"])


def test_docker_sandbox_keys_load() -> None:
    cfg = load_config(None, ["sandbox.kind=docker", "sandbox.docker_host=unix:///run/podman/podman.sock",
                             "sandbox.image=my/image:1"])
    assert (cfg.sandbox.kind, cfg.sandbox.docker_host, cfg.sandbox.image) == (
        "docker", "unix:///run/podman/podman.sock", "my/image:1")


def test_keys_their_backend_honours_still_load() -> None:
    cfg = load_config(None, ["engine.kind=vllm", "engine.urls=[http://gpu1:8000]", "engine.checkpoint_dir=/shared",
                             "engine.torch_threads=2"])
    assert cfg.engine.urls == ["http://gpu1:8000"] and cfg.engine.checkpoint_dir == "/shared"
    assert load_config(None, ["engine.max_batch=4", "engine.prefix_cache_mb=0"]).engine.max_batch == 4
    assert load_config(None, ["proxy.port=8000"]).proxy.port == 8000
    cfg = load_config(None, ["sft.teacher=upstream", "sft.teacher_url=https://host/v1", "sft.teacher_model=big"])
    assert cfg.sft.teacher_model == "big"


def test_a_saved_config_with_every_key_spelled_out_loads_again(tmp_path: Path) -> None:
    """`legorl train --resume` reads RUN_DIR/config.json, which spells out every default."""
    import json

    from legorl.config import Config

    for overrides in ([], ["engine.kind=vllm", "engine.urls=[http://gpu1:8000]"], ["sft.teacher=upstream",
                                                                                  "sft.teacher_url=u",
                                                                                  "sft.teacher_model=m"]):
        saved = tmp_path / "config.json"
        saved.write_text(json.dumps(load_config(None, overrides).model_dump()))
        assert load_config(saved) == Config.model_validate(json.loads(saved.read_text()))
