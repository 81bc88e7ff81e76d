"""Sampling defaults from generation_config.json, by vLLM's rules (server/generation_defaults.py)."""

from __future__ import annotations

import json

import pytest

from engine.generation_defaults import GenerationConfigError, SamplingDefaults

QWEN2_VL_INSTRUCT = {  # the hub's Qwen2-VL-7B-Instruct generation_config.json
    "bos_token_id": 151643,
    "pad_token_id": 151643,
    "do_sample": True,
    "eos_token_id": [151645, 151643],
    "repetition_penalty": 1.05,
    "temperature": 0.01,
    "top_p": 0.001,
    "top_k": 1,
    "transformers_version": "4.37.0",
}


def folder_with(tmp_path, config: dict):
    (tmp_path / "generation_config.json").write_text(json.dumps(config))
    return tmp_path


def test_the_model_folders_recommendations_become_the_defaults(tmp_path):
    defaults = SamplingDefaults.load("auto", folder_with(tmp_path, QWEN2_VL_INSTRUCT))
    assert defaults == SamplingDefaults(temperature=0.01, top_p=0.001, top_k=1,
                                        repetition_penalty=1.05)  # fmt: skip
    assert defaults.changed() == {"temperature": 0.01, "top_p": 0.001, "top_k": 1,
                                  "repetition_penalty": 1.05}  # fmt: skip


def test_values_at_transformers_defaults_are_not_recommendations(tmp_path):
    """GenerationConfig.to_diff_dict() drops them for vLLM: top_k 50 is transformers' own
    default, not the author's choice, so it does not switch top-k on."""
    config = {"temperature": 1.0, "top_p": 1.0, "top_k": 50, "repetition_penalty": 1.0,
              "min_p": None, "do_sample": False}  # fmt: skip
    assert SamplingDefaults.load("auto", folder_with(tmp_path, config)) == SamplingDefaults()


def test_none_keeps_openai_defaults_and_an_override_lies_over_the_file(tmp_path):
    folder = folder_with(tmp_path, QWEN2_VL_INSTRUCT)
    assert SamplingDefaults.load("none", folder) == SamplingDefaults()
    override = '{"temperature": 0.7, "top_k": -1, "max_new_tokens": 256}'
    defaults = SamplingDefaults.load("auto", folder, override)
    assert (defaults.temperature, defaults.top_k, defaults.top_p) == (0.7, 0, 0.001)
    assert SamplingDefaults.load("none", folder, '{"min_p": 0.05}').min_p == 0.05


def test_a_folder_path_and_a_missing_file(tmp_path):
    other = tmp_path / "other"
    other.mkdir()
    folder_with(other, {"temperature": 0.6, "top_p": 0.95, "top_k": 20})
    assert SamplingDefaults.load(str(other), tmp_path).top_k == 20
    assert SamplingDefaults.load("auto", tmp_path) == SamplingDefaults()  # no file: OpenAI's
    with pytest.raises(GenerationConfigError, match="no generation_config.json"):
        SamplingDefaults.load(str(tmp_path / "nowhere"), tmp_path)


@pytest.mark.parametrize(
    "override, message",
    [
        ('{"temperature": -1}', "temperature must be a number in"),
        ('{"top_p": 0}', "top_p must be a number in"),
        ('{"top_k": 1.5}', "top_k must be an integer"),
        ('{"repetition_penalty": 0}', "repetition_penalty"),
        ('{"max_new_tokens": 0}', "max_new_tokens must be an integer >= 1"),
        ('{"temperature": true}', "temperature"),
        ('{"seed": 3}', "unknown generation config fields"),
        ("[1]", "must be a JSON object"),
        ("{temperature", "is not JSON"),
    ],
)
def test_bad_values_fail_at_start_up(tmp_path, override, message):
    with pytest.raises(GenerationConfigError, match=message):
        SamplingDefaults.load("none", tmp_path, override)


def test_max_new_tokens_caps_every_request():
    defaults = SamplingDefaults(max_tokens=64)
    assert defaults.max_tokens_for(None, room=1000) == 64
    assert defaults.max_tokens_for(500, room=1000) == 64
    assert defaults.max_tokens_for(10, room=1000) == 10
    assert SamplingDefaults().max_tokens_for(None, room=1000) == 1000


def test_a_bad_value_in_the_file_names_the_file(tmp_path):
    folder = folder_with(tmp_path, {"temperature": 3.5})
    with pytest.raises(GenerationConfigError, match="generation_config.json: temperature"):
        SamplingDefaults.load("auto", folder)
    assert SamplingDefaults.load("none", folder) == SamplingDefaults()


@pytest.mark.parametrize(
    ("generation_config", "override", "source", "advises_none"),
    [
        ("auto", None, "the generation config", True),
        ("auto", '{"top_k": 5}', "the generation config", False),
        ("none", '{"temperature": 0.5}', "--override-generation-config", False),
    ],
)
def test_the_start_up_line_names_where_the_defaults_came_from(
    tmp_path, caplog, generation_config, override, source, advises_none
):
    """With --generation-config none and an override it advised "--generation-config none
    keeps OpenAI's", the flag already given (fuzz86)."""
    line = start_up_line(tmp_path, caplog, generation_config, override)
    assert line.startswith(f"sampling defaults from {source} ")
    assert ("--generation-config none keeps OpenAI's" in line) == advises_none


def start_up_line(tmp_path, caplog, generation_config: str, override: str | None) -> str:
    """The one line load_sampling_defaults logs for QWEN2_VL_INSTRUCT's folder."""
    import logging

    from engine.config import EngineConfig
    from server.app_state import load_sampling_defaults
    from server.settings import ServerSettings

    folder = folder_with(tmp_path, QWEN2_VL_INSTRUCT)
    settings = ServerSettings(engine=EngineConfig(model=str(folder)),
                              generation_config=generation_config,
                              override_generation_config=override)  # fmt: skip
    with caplog.at_level(logging.WARNING):
        load_sampling_defaults(settings)
    [line] = [record.getMessage() for record in caplog.records]
    return line


LEAVES_OUT = "(for fields a request leaves out)"


@pytest.mark.parametrize(
    ("generation_config", "override", "expected"),
    [
        ("auto", None, f"sampling defaults from the generation config {LEAVES_OUT}: "
         "temperature=0.01, top_p=0.001, top_k=1, repetition_penalty=1.05; "
         "--generation-config none keeps OpenAI's"),
        ("auto", '{"top_k": 5}', f"sampling defaults from the generation config {LEAVES_OUT}: "
         "temperature=0.01, top_p=0.001, repetition_penalty=1.05; "
         "from --override-generation-config: top_k=5"),
        ("auto", '{"temperature": 0.5, "max_new_tokens": 64}',
         f"sampling defaults from --override-generation-config {LEAVES_OUT}: temperature=0.5, "
         "max_tokens=64; from the generation config: top_p=0.001, top_k=1, "
         "repetition_penalty=1.05"),
        ("auto", '{"temperature": 0.5, "top_p": 0.9, "top_k": 5, "repetition_penalty": 1.1}',
         f"sampling defaults from --override-generation-config {LEAVES_OUT}: temperature=0.5, "
         "top_p=0.9, top_k=5, repetition_penalty=1.1"),
        ("none", '{"temperature": 0.5}',
         f"sampling defaults from --override-generation-config {LEAVES_OUT}: temperature=0.5"),
    ],
)  # fmt: skip
def test_the_start_up_line_names_each_fields_source(
    tmp_path, caplog, generation_config, override, expected
):
    """It put the override's fields under "the generation config" too (fuzz88)."""
    assert start_up_line(tmp_path, caplog, generation_config, override) == expected
