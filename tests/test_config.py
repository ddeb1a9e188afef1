import subprocess
import sys
from pathlib import Path

import pytest

from legorl.config import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[1]


def test_shipped_configs_load():
    for path in sorted((ROOT / "configs").glob("*.yaml")):
        cfg = load_config(path)
        assert cfg.run.steps >= 0, path


def test_dotted_overrides_are_typed():
    cfg = load_config(ROOT / "configs/smoke.yaml", ["trainer.lr=1e-5", "rollout.group_size=4",
                                                    "tasks.families=[off_by_one, wrong_operator]"])
    assert cfg.trainer.lr == pytest.approx(1e-5)
    assert cfg.rollout.group_size == 4
    assert cfg.tasks.families == ["off_by_one", "wrong_operator"]


def test_unknown_key_is_one_clear_line():
    with pytest.raises(ConfigError) as e:
        load_config(ROOT / "configs/smoke.yaml", ["trainer.lrr=1e-5"])
    msg = str(e.value)
    assert "unknown key 'trainer.lrr'" in msg and "\n" not in msg


def test_bad_value_names_key_and_type():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["rollout.group_size=many"])
    msg = str(e.value)
    assert "'rollout.group_size'" in msg and "integer" in msg and "\n" not in msg


def test_sft_epochs_take_fractions_but_not_zero():
    assert load_config(None, ["sft.epochs=4.5"]).sft.epochs == 4.5
    with pytest.raises(ConfigError) as e:  # refused before any demonstration is collected
        load_config(None, ["sft.epochs=0"])
    assert "'sft.epochs'" in str(e.value) and "greater than 0" in str(e.value)


def test_tools_first_is_the_builtin_tokenizers_switch():
    assert load_config(None, ["model.tools_first=true"]).model.tools_first
    with pytest.raises(ConfigError, match="brings its own template"):
        load_config(None, ["model.tools_first=true", "model.path=/some/checkpoint"])


def test_ray_without_ray_installed_says_how_to_install(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "ray" else real(name))
    with pytest.raises(ConfigError) as e:
        load_config(None, ["ray.address=local"])
    msg = str(e.value)
    assert "'ray.address'" in msg and "pip install 'legorl[ray]'" in msg and "\n" not in msg
    assert load_config(None, []).ray.address is None  # no Ray by default: nothing to install


def test_bad_yaml_and_missing_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("run: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.yaml")


def test_cli_reports_config_error_without_traceback(tmp_path):
    p = subprocess.run([sys.executable, "-m", "legorl.cli", "train", "--config", str(ROOT / "configs/smoke.yaml"),
                        "--run-dir", str(tmp_path / "r"), "sampling.temperature=-1"],
                       capture_output=True, text=True, timeout=120, check=False)
    assert p.returncode == 2
    assert "sampling.temperature" in p.stderr and "Traceback" not in p.stderr


def test_empty_rl_task_pool_fails_before_anything_starts(tmp_path):
    p = subprocess.run([sys.executable, "-m", "legorl.cli", "train", "--config", str(ROOT / "configs/smoke.yaml"),
                        "--run-dir", str(tmp_path / "r"), "rollout.task_pool=undemonstrated", "sft.enabled=true",
                        "sft.demos=8", "tasks.n_train=8"], capture_output=True, text=True, timeout=120,
                       check=False)
    assert p.returncode == 2, p.stderr[-2000:]
    assert "rollout.task_pool" in p.stderr and "tasks.n_train" in p.stderr and "Traceback" not in p.stderr
    assert not (tmp_path / "r" / "store.sqlite").exists()


def test_teacher_switches_are_refused_where_they_would_do_nothing():
    assert load_config(None, ["sft.check_edits=true", "sft.recovery_demos=0.5"]).sft.recovery_demos == 0.5
    with pytest.raises(ConfigError, match="needs sft.check_edits"):
        load_config(None, ["sft.recovery_demos=0.5"])
    with pytest.raises(ConfigError, match="scripted teacher"):
        load_config(None, ["sft.teacher=upstream", "sft.check_edits=true"])


def test_cli_sets_openmp_wait_policy_before_torch_loads():
    # legorl.cli.main sets OMP_WAIT_POLICY=PASSIVE, which OpenMP reads only when torch loads: the
    # CLI module must not import torch itself, and the main entry point must set it (a user's own
    # value wins).
    import subprocess
    import sys

    code = (
        "import os, sys\n"
        "os.environ.pop('OMP_WAIT_POLICY', None)\n"
        "import legorl.cli as cli\n"
        "assert 'torch' not in sys.modules, 'legorl.cli imports torch at import time'\n"
        "sys.argv = ['legorl', '--help']\n"
        "try:\n    cli.main()\nexcept SystemExit:\n    pass\n"
        "print(os.environ['OMP_WAIT_POLICY'])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "PASSIVE"
    env = {**__import__("os").environ, "OMP_WAIT_POLICY": "ACTIVE"}
    code_user = code.replace("os.environ.pop('OMP_WAIT_POLICY', None)\n", "")
    out = subprocess.run([sys.executable, "-c", code_user], capture_output=True, text=True, check=True, env=env)
    assert out.stdout.strip().splitlines()[-1] == "ACTIVE"
