"""Every YAML under configs/ loads through the real settings loader, with its own keys."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml

from engine.config import EngineConfig

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))
ENGINE_FIELDS = {field.name for field in dataclasses.fields(EngineConfig)}
EXPECTED = {
    "default-tiny.yaml",
    "qwen2-vl-2b-instruct-gpu.yaml",
    "qwen2.5-vl-7b-instruct-gpu.yaml",
    "cpu.yaml",
}

settings_module = pytest.importorskip(
    "server.settings", reason="server/settings.py (load_settings) is not in the tree yet"
)


def _load(path: Path, environ: dict[str, str] | None = None):
    environ = {"TESSERA_CACHE_DIR": "/nonexistent/tessera-cache", **(environ or {})}
    return settings_module.load_settings(["--config", str(path)], environ)


def test_expected_configs_exist():
    assert EXPECTED <= {path.name for path in CONFIGS}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_config_loads_and_every_key_takes_effect(path: Path):
    raw = yaml.safe_load(path.read_text())
    assert isinstance(raw, dict) and raw, f"{path.name} should be a non-empty mapping"
    settings = _load(path)
    for key, value in raw.items():
        owner = settings.engine if key in ENGINE_FIELDS else settings
        actual = getattr(owner, key)
        assert actual == value, f"{path.name}: {key} = {value!r} but settings have {actual!r}"


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_environment_and_flags_override_the_file(path: Path):
    settings = settings_module.load_settings(
        ["--config", str(path), "--port", "9123"],
        {"TESSERA_CACHE_DIR": "/nonexistent", "TESSERA_MAX_NUM_SEQS": "3", "TESSERA_PORT": "1"},
    )
    assert settings.engine.max_num_seqs == 3
    assert settings.port == 9123


def test_default_tiny_serves_the_built_in_model():
    raw = yaml.safe_load((ROOT / "configs" / "default-tiny.yaml").read_text())
    assert "model" not in raw, "default-tiny.yaml must leave the model to the built-in default"
    settings = _load(ROOT / "configs" / "default-tiny.yaml")
    assert settings.engine.model == "/nonexistent/tessera-cache/default-model-2"


def test_shapes_pick_their_device():
    gpu = _load(ROOT / "configs" / "qwen2-vl-2b-instruct-gpu.yaml")
    assert gpu.engine.device == "cuda" and gpu.engine.dtype == "bfloat16"
    assert gpu.engine.model.startswith("/models/"), "the image documents models under /models"
    assert gpu.host == "0.0.0.0"
    cpu = _load(ROOT / "configs" / "cpu.yaml")
    assert cpu.engine.device == "cpu" and cpu.engine.attention_backend == "torch"


def test_a_typo_in_a_config_is_an_error(tmp_path: Path):
    bad = tmp_path / "bad.yaml"
    bad.write_text((ROOT / "configs" / "cpu.yaml").read_text() + "max_num_seq: 4\n")
    with pytest.raises(settings_module.SettingsError, match="max_num_seq"):
        _load(bad)


@pytest.mark.parametrize("seed", [None, True, "7", 2**64])
def test_a_seed_that_is_no_64_bit_integer_is_a_clear_error(seed):
    """`LLM(model, seed=None)` (vLLM's "no fixed seed") raised "'<=' not supported between
    instances of 'int' and 'NoneType'" (fuzz111)."""
    with pytest.raises(ValueError, match="seed must be a 64-bit integer"):
        EngineConfig(model="unused", seed=seed)


def test_vllms_dtype_names_half_and_float_are_taken():
    """`LLM(model, dtype="half")`, as scripts written for vLLM say it, was refused (fuzz111)."""
    assert EngineConfig(model="unused", dtype="half").dtype == "float16"
    assert EngineConfig(model="unused", dtype="float").dtype == "float32"
    with pytest.raises(ValueError, match="dtype must be one of"):
        EngineConfig(model="unused", dtype="double")
