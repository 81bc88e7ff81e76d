"""ServerSettings loading: CLI > env > YAML > defaults, flags generated from the fields."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from engine.config import EngineConfig
from server.default_model import default_model_dir
from server.settings import (
    FIELDS,
    ServerSettings,
    SettingsError,
    build_parser,
    load_settings,
    unknown_environment_variables,
)


def _yaml(tmp_path: Path, text: str) -> str:
    path = tmp_path / "tessera.yaml"
    path.write_text(text)
    return str(path)


def test_defaults() -> None:
    settings = load_settings(["--model", "/models/m"], {})
    assert settings.engine == EngineConfig(model="/models/m")
    assert settings.port == 8000 and settings.host == "0.0.0.0" and settings.api_key is None
    assert settings.log_format == "text" and settings.allow_private_media_urls is False
    assert settings.model_name == "m"


def test_precedence_cli_over_env_over_yaml_over_default(tmp_path: Path) -> None:
    config = _yaml(
        tmp_path,
        "model: /from/yaml\nmax_num_seqs: 3\nport: 7000\nblock_size: 32\napi_key: yaml-key\n",
    )
    environ = {"TESSERA_MAX_NUM_SEQS": "5", "TESSERA_PORT": "7100", "TESSERA_API_KEY": "env-key"}
    settings = load_settings(["--config", config, "--max-num-seqs", "9"], environ)
    assert settings.engine.max_num_seqs == 9  # CLI
    assert settings.port == 7100 and settings.api_key == "env-key"  # env over YAML
    assert settings.engine.block_size == 32 and settings.engine.model == "/from/yaml"  # YAML
    assert settings.engine.max_num_batched_tokens == 2048  # default
    # TESSERA_CONFIG names the YAML file when --config is absent.
    settings = load_settings([], {"TESSERA_CONFIG": config})
    assert settings.engine.max_num_seqs == 3 and settings.port == 7000


def test_bool_flags_env_and_yaml(tmp_path: Path) -> None:
    base = ["--model", "m"]
    assert load_settings(base, {}).engine.enable_prefix_caching is True
    assert (
        load_settings([*base, "--no-enable-prefix-caching"], {}).engine.enable_prefix_caching
        is False
    )
    assert load_settings([*base, "--no-split-media"], {}).engine.split_media is False
    settings = load_settings([*base, "--allow-private-media-urls"], {})
    assert settings.allow_private_media_urls is True
    env = {"TESSERA_ENABLE_PREFIX_CACHING": "false", "TESSERA_ALLOW_PRIVATE_MEDIA_URLS": "1"}
    settings = load_settings(base, env)
    assert settings.engine.enable_prefix_caching is False and settings.allow_private_media_urls
    # CLI beats env for booleans too.
    settings = load_settings([*base, "--enable-prefix-caching"], env)
    assert settings.engine.enable_prefix_caching is True
    settings = load_settings(["--config", _yaml(tmp_path, "split_media: false\n")], {})
    assert settings.engine.split_media is False
    with pytest.raises(SettingsError, match="TESSERA_SPLIT_MEDIA"):
        load_settings(base, {"TESSERA_SPLIT_MEDIA": "maybe"})


def test_types_and_optional_values(tmp_path: Path) -> None:
    settings = load_settings(
        ["--model", "m", "--max-model-len", "4096", "--kv-cache-memory-gib", "1.5"],
        {"TESSERA_NUM_KV_BLOCKS": "128", "TESSERA_API_KEY": "none"},
    )
    assert settings.engine.max_model_len == 4096 and settings.engine.kv_cache_memory_gib == 1.5
    assert settings.engine.num_kv_blocks == 128 and settings.api_key is None
    with pytest.raises(SettingsError, match="--max-num-seqs"):
        load_settings(["--max-num-seqs", "many"], {})
    with pytest.raises(SettingsError, match="max_num_seqs"):
        load_settings(["--config", _yaml(tmp_path, "max_num_seqs: '8'\n")], {})
    with pytest.raises(SettingsError, match="port"):
        load_settings(["--config", _yaml(tmp_path, "port: true\n")], {})
    yaml_settings = load_settings(["--config", _yaml(tmp_path, "kv_cache_memory_gib: 4\n")], {})
    assert yaml_settings.engine.kv_cache_memory_gib == 4.0
    with pytest.raises(SettingsError, match="log_format"):
        load_settings(["--log-format", "xml"], {})


def test_api_server_count_is_checked() -> None:
    assert load_settings(["--api-server-count", "4"], {}).api_server_count == 4
    with pytest.raises(SettingsError, match="api_server_count must be in 1..64"):
        load_settings(["--api-server-count", "0"], {})
    addresses = ["--engine-inbox-address", "tcp://127.0.0.1:5001",
                 "--engine-outbox-address", "tcp://127.0.0.1:5002"]  # fmt: skip
    assert load_settings(addresses, {}).api_server_count == 1
    with pytest.raises(SettingsError, match="unset engine_inbox_address"):
        load_settings([*addresses, "--api-server-count", "2"], {})
    for bad in ("foo", "tcp://127.0.0.1:99999", "tcp://127.0.0.1:0"):
        with pytest.raises(SettingsError, match="must be tcp://HOST:PORT or ipc://PATH"):
            load_settings(["--engine-inbox-address", bad, "--engine-outbox-address", "bar"], {})


@pytest.mark.parametrize(
    "flag,value",
    [("--max-num-seqs", "0"), ("--max-num-seqs", "-3"), ("--max-num-batched-tokens", "0"),
     ("--block-size", "0"), ("--block-size", "-16"), ("--max-model-len", "0"),
     ("--max-model-len", "-5")],
)  # fmt: skip
def test_scheduler_limits_must_be_positive(flag: str, value: str) -> None:
    """Each of these started a server whose every request waited forever, read 0 as the
    model's context, or failed in the engine with a ZeroDivisionError."""
    name = flag.removeprefix("--").replace("-", "_")
    with pytest.raises(SettingsError, match=f"{name} must be positive"):
        load_settings([flag, value], {})


def test_a_range_error_names_where_its_value_came_from(tmp_path: Path) -> None:
    """A flag, an environment variable or the YAML file: the message named the setting
    alone, and left the user to find which had set it (fuzz51)."""
    config = _yaml(tmp_path, "max_tools: 0\nmax_num_seqs: 4\n")
    cases = [
        (["--max-tools", "0"], {}, "(set by --max-tools)"),
        ([], {"TESSERA_MAX_TOOLS": "-1"}, "(set by TESSERA_MAX_TOOLS)"),
        (["--config", config], {}, f"(set by {config})"),
        (["--config", config], {"TESSERA_MAX_TOOLS": "0"}, "(set by TESSERA_MAX_TOOLS)"),
    ]
    for argv, environ, source in cases:
        with pytest.raises(SettingsError) as refused:
            load_settings(argv, environ)
        assert str(refused.value).startswith("max_tools must be positive"), refused.value
        assert str(refused.value).endswith(source), refused.value


def test_small_batch_linear_rows_stay_within_the_kernels_rows() -> None:
    assert load_settings(["--small-batch-linear-rows", "8"], {}).engine.small_batch_linear_rows == 8
    for rows in ("9", "-1"):
        with pytest.raises(SettingsError, match=r"small_batch_linear_rows must be in \[0, 8\]"):
            load_settings(["--small-batch-linear-rows", rows], {})


def test_yaml_errors_and_nested_engine_section(tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match="unknown setting 'max_num_seq'"):
        load_settings(["--config", _yaml(tmp_path, "max_num_seq: 4\n")], {})
    with pytest.raises(SettingsError, match="unknown setting 'port'"):
        load_settings(["--config", _yaml(tmp_path, "engine:\n  port: 1\n")], {})
    with pytest.raises(SettingsError, match="set twice"):
        load_settings(["--config", _yaml(tmp_path, "seed: 1\nengine:\n  seed: 2\n")], {})
    with pytest.raises(SettingsError, match="mapping"):
        load_settings(["--config", _yaml(tmp_path, "- a\n- b\n")], {})
    with pytest.raises(SettingsError, match="cannot read"):
        load_settings(["--config", str(tmp_path / "missing.yaml")], {})
    for nothing in ("0", "[]", "''", "false"):  # were taken for no engine section (fuzz34)
        with pytest.raises(SettingsError, match="'engine' must be a mapping"):
            load_settings(["--config", _yaml(tmp_path, f"engine: {nothing}\n")], {})
    assert load_settings(["--config", _yaml(tmp_path, "engine:\n")], {}).engine.seed == 0
    latin1 = tmp_path / "latin1.yaml"  # a traceback, exit 1 (fuzz34)
    latin1.write_bytes("# café\nseed: 1\n".encode("latin-1"))
    with pytest.raises(SettingsError, match="not UTF-8"):
        load_settings(["--config", str(latin1)], {})
    text = "port: 9000\nengine:\n  model: /m\n  max_num_seqs: 2\n"
    settings = load_settings(["--config", _yaml(tmp_path, text)], {})
    assert settings.port == 9000 and settings.engine.max_num_seqs == 2
    assert settings.engine.model == "/m"


def test_every_field_has_a_flag_and_env_var() -> None:
    parser_flags = {opt for action in build_parser()._actions for opt in action.option_strings}
    names = [f.name for f in dataclasses.fields(EngineConfig)]
    names += [f.name for f in dataclasses.fields(ServerSettings) if f.name != "engine"]
    assert sorted(FIELDS) == sorted(names)  # server and engine names never collide
    for name in names:
        assert "--" + name.replace("_", "-") in parser_flags
        assert FIELDS[name].env == "TESSERA_" + name.upper()
    assert "--no-enable-prefix-caching" in parser_flags


def test_default_model_dir(tmp_path: Path) -> None:
    settings = load_settings([], {"TESSERA_CACHE_DIR": str(tmp_path)})
    assert Path(settings.engine.model) == tmp_path / "default-model-2"
    assert default_model_dir({}) == Path("~/.cache/tessera/default-model-2").expanduser()


def test_default_model_is_generated_once_atomically(tmp_path: Path) -> None:
    from server.default_model import ensure_default_model, is_default_model

    path = tmp_path / "default-model-2"
    assert ensure_default_model(path) == path
    assert (path / "config.json").is_file() and (path / "model.safetensors").is_file()
    assert [p.name for p in tmp_path.iterdir()] == ["default-model-2"]  # no staging left over
    mtime = (path / "model.safetensors").stat().st_mtime_ns
    ensure_default_model(path)  # reused, not regenerated
    assert (path / "model.safetensors").stat().st_mtime_ns == mtime
    assert is_default_model(str(path), {"TESSERA_CACHE_DIR": str(tmp_path)})
    assert not is_default_model("/models/other", {"TESSERA_CACHE_DIR": str(tmp_path)})


def test_cli_usage_errors(capsys: pytest.CaptureFixture) -> None:
    from server.cli import main

    assert main([]) == 2
    assert main(["frobnicate"]) == 2
    assert "unknown command" in capsys.readouterr().err
    assert main(["serve", "--config", "/nonexistent/tessera.yaml"]) == 2
    assert "cannot read config file" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    assert "--max-num-seqs" in capsys.readouterr().out


def test_cli_make_tiny_model(tmp_path: Path) -> None:
    from server.cli import main

    assert main(["make-tiny-model", str(tmp_path / "m")]) == 0
    assert (tmp_path / "m" / "config.json").is_file()


def test_make_tiny_model_into_a_folder_it_cannot_create_is_one_line(tmp_path, capsys):
    """/dev/null/x printed a NotADirectoryError traceback (fuzz62)."""
    from server.cli import main

    (tmp_path / "afile").write_text("x")
    with pytest.raises(SystemExit) as exited:
        main(["make-tiny-model", str(tmp_path / "afile" / "m")])
    assert exited.value.code == 2
    assert "cannot create OUT_DIR" in capsys.readouterr().err


@pytest.mark.parametrize("value", ["0", "-1"])
def test_the_video_decode_time_must_be_positive(value: str) -> None:
    with pytest.raises(SettingsError, match="max_video_decode_seconds must be positive"):
        load_settings(["--max-video-decode-seconds", value], {})
    assert load_settings(["--max-video-decode-seconds", "5"], {}).max_video_decode_seconds == 5


@pytest.mark.parametrize(
    "flag,value,says",
    [("--request-read-timeout-s", "0", "request_read_timeout_s must be positive"),
     ("--timeout-keep-alive-s", "0", "timeout_keep_alive_s must be positive"),
     ("--shutdown-timeout-s", "-5", "shutdown_timeout_s must be positive"),
     ("--max-waiting-tokens", "0", "max_waiting_tokens must be positive"),
     ("--max-waiting-requests", "-1", "max_waiting_requests must be >= 0")],
)  # fmt: skip
def test_timeouts_and_waiting_bounds_are_checked(flag: str, value: str, says: str) -> None:
    """Each was taken as given (a negative drain, a keep-alive of 0, a waiting room of -1)."""
    with pytest.raises(SettingsError, match=says):
        load_settings([flag, value], {})
    assert load_settings(["--max-waiting-requests", "0"], {}).max_waiting_requests == 0


def test_an_engine_step_timeout_shorter_than_the_idle_poll_is_refused() -> None:
    """0.3 s ended an idle engine right after it was ready (it polls every 0.5 s)."""
    with pytest.raises(SettingsError, match="engine_step_timeout_s must be 0"):
        load_settings(["--engine-step-timeout-s", "0.3"], {})
    assert load_settings(["--engine-step-timeout-s", "0"], {}).engine.engine_step_timeout_s == 0


@pytest.mark.parametrize(
    "flag,value",
    [("--media-fetch-timeout-s", "nan"), ("--shutdown-timeout-s", "inf"),
     ("--video-fps", "inf"), ("--kv-cache-memory-gib", "inf"),
     ("--engine-startup-timeout-s", "nan"), ("--engine-startup-timeout-s", "-1"),
     ("--kv-cache-scale", "0"), ("--kv-cache-scale", "nan"),
     ("--feature-fetch-timeout-s", "0"), ("--feature-fetch-retries", "-1"),
     ("--feature-fetch-parallel", "0"), ("--max-feature-bytes", "0"),
     ("--num-kv-blocks", "0"), ("--num-threads", "0"), ("--encoder-cache-tokens", "-1"),
     ("--max-encoder-tokens-per-step", "0"), ("--cuda-graph-max-batch-size", "0"),
     ("--cuda-graph-max-seq-len", "-1"), ("--max-image-pixels", "0"),
     ("--max-images-per-request", "-1"), ("--image-cache-mb", "-1"),
     ("--media-fetch-max-redirects", "-1"), ("--seed", str(2**64)),
     ("--seed", str(-(2**63) - 1))],
)  # fmt: skip
def test_every_limit_out_of_its_range_is_refused_at_start_up(flag: str, value: str) -> None:
    """Each was accepted: a NaN fetch deadline, a start-up deadline of -1 s, a KV scale of 0
    (found only after the model loaded), no KV blocks (after loading too), and negative
    sizes of caches and redirects taken as given."""
    name = flag.removeprefix("--").replace("-", "_")
    with pytest.raises(SettingsError, match=name):
        load_settings([flag, value], {})


def test_zero_still_means_off_or_none_where_a_limit_says_so() -> None:
    settings = load_settings(
        ["--feature-fetch-retries", "0", "--max-images-per-request", "0", "--image-cache-mb", "0",
         "--media-fetch-max-redirects", "0", "--grammar-cache-size", "0", "--engine-step-timeout-s",
         "0", "--num-threads", "none", "--num-kv-blocks", "none"], {},
    )  # fmt: skip
    assert settings.image_cache_mb == 0 and settings.engine.feature_fetch_retries == 0
    assert settings.engine.num_kv_blocks is None and settings.engine.num_threads is None


@pytest.mark.parametrize("given, key", [("sk-1\n", "sk-1"), ("  sk-1 ", "sk-1"), ("", None),
                                        ("  \n", None)])  # fmt: skip
def test_an_api_key_is_taken_without_surrounding_whitespace_and_empty_is_none(given, key):
    """A key from a file (kubectl create secret --from-file) ends in a newline, which no
    client can send: every request got 401. An empty key (an optional Secret left empty)
    turned auth off and also hid the "no API key" warning, which looks for None."""
    assert load_settings([], {"TESSERA_API_KEY": given}).api_key == key
    assert load_settings(["--api-key", given], {}).api_key == key


@pytest.mark.parametrize("key", ["clé", "sk-\x01", "sk\u2009key"])
def test_an_api_key_no_client_can_send_is_refused_at_start_up(key):
    """A key like "clé" started the server, then every request got 401: Starlette reads
    header bytes as Latin-1, and the check compared them with the key's UTF-8."""
    with pytest.raises(SettingsError, match="api_key must be printable ASCII"):
        load_settings(["--api-key", key], {})


@pytest.mark.parametrize("flag, value", [("--dtype", "fp32"), ("--kv-cache-dtype", "fp16"),
                                         ("--attention-backend", "flash")])  # fmt: skip
def test_an_unknown_dtype_or_backend_is_refused_with_the_settings(flag, value):
    """They passed the settings and failed in the engine process: a traceback, and exit 1,
    the code that asks a supervisor to restart the server (fuzz34)."""
    with pytest.raises(SettingsError, match=flag.removeprefix("--").replace("-", "_")):
        load_settings([flag, value], {})


@pytest.mark.parametrize("device", ["gpu", "tpu", "cuda0", "cuda:x", ""])
def test_an_unknown_device_is_refused_before_the_engine_starts(device):
    """It failed in the engine process with a traceback, and the last line gave no reason."""
    with pytest.raises(SettingsError, match="device"):
        load_settings(["--device", device], {})
    for good in ("auto", "cpu", "cuda", "cuda:1"):
        assert load_settings(["--device", good], {}).engine.device == good


def test_a_cache_dir_that_cannot_hold_the_default_model_is_one_line(tmp_path, capsys):
    """It was a traceback (NotADirectoryError, PermissionError) and exit 1."""
    from server.cli import main

    blocker = tmp_path / "a-file"
    blocker.write_text("")
    env = {"TESSERA_CACHE_DIR": str(blocker / "cache")}
    import os
    from unittest import mock

    with mock.patch.dict(os.environ, env):
        assert main(["serve"]) == 2
    err = capsys.readouterr().err
    assert "TESSERA_CACHE_DIR" in err and "Traceback" not in err


def test_an_incomplete_default_model_folder_is_replaced_and_old_staging_removed(tmp_path):
    """A folder without config.json (a partial copy) failed every start ("Directory not
    empty"); a killed generation's staging folder was left for ever."""
    import os
    import time

    from server.default_model import ensure_default_model

    path = tmp_path / "default-model-2"
    path.mkdir()
    (path / "model.safetensors").write_text("partial")
    stale = tmp_path / ".default-model-killed"
    stale.mkdir()
    old = time.time() - 3600
    os.utime(stale, (old, old))
    assert ensure_default_model(path) == path
    assert (path / "config.json").is_file() and not stale.exists()


def test_none_is_none_in_every_spelling_and_source(tmp_path):
    """`--generation-config None` was read as a folder named None, and in YAML the word
    none was a string: `api_key: none` set the key to "none", `allowed_media_domains: none`
    allowed one host named none."""
    from engine.generation_defaults import SamplingDefaults

    assert SamplingDefaults.load("None", tmp_path) == SamplingDefaults.load("none", tmp_path)
    config = tmp_path / "c.yaml"
    config.write_text("api_key: none\nallowed_media_domains: NULL\nserved_model_name: None\n")
    settings = load_settings(["--config", str(config)], {})
    assert settings.api_key is None and settings.allowed_media_domains is None
    assert settings.engine.served_model_name is None


def test_flags_are_not_abbreviated():
    """argparse took --max-num-s for --max-num-seqs: a flag added later could make such a
    script's abbreviation ambiguous, or mean another flag."""
    with pytest.raises(SystemExit):
        load_settings(["--max-num-s", "3"], {})


@pytest.mark.parametrize("prefixes, says", [
    ("https://feat.example", "must end in '/'"),
    ("s3://feat", "must end in '/'"),
    ("http://a.example/ok/,https://b.example", "must end in '/'"),
    ("feat.example/", "must begin with"),
    ("S3://feat/", "must begin with"),  # no s3 URL is spelt so: it would match none
])  # fmt: skip
def test_an_allowed_feature_url_prefix_names_a_folder(prefixes, says):
    """`https://feat.example` was taken, and let https://feat.example.evil.net through
    (fuzz62); an entry of no known scheme was dropped without a word."""
    with pytest.raises(SettingsError, match=says):
        load_settings(["--allowed-feature-url-prefixes", prefixes], {})
    good = "https://feat.example/,s3://feat/videos/,data:,"  # a trailing comma is nothing
    settings = load_settings(["--allowed-feature-url-prefixes", good], {})
    assert settings.engine.allowed_feature_url_prefixes == good


def test_a_local_media_path_must_be_a_folder(tmp_path):
    """A missing folder, or a file, was taken: every file:// image was then refused as the
    client's fault, for the operator's typo (fuzz62; vLLM refuses both at start-up)."""
    afile = tmp_path / "afile"
    afile.write_text("x")
    for path, says in ((tmp_path / "missing", "does not exist"), (afile, "not a folder")):
        with pytest.raises(SettingsError, match=says):
            load_settings(["--allowed-local-media-path", str(path)], {})
    assert load_settings(["--allowed-local-media-path", str(tmp_path)], {})
    unset = load_settings(["--allowed-local-media-path", ""], {})
    assert unset.allowed_local_media_path in ("", None)
    # checked expanded, and kept so: the fetcher resolved '~' as a folder name (fuzz66)
    home = load_settings(["--allowed-local-media-path", "~"], {})
    assert home.allowed_local_media_path == str(Path.home())


def test_a_model_path_under_the_home_folder_is_expanded(tmp_path):
    """`~/models/x` (from YAML, an env file or a quoted flag) passed the pre-flight, which
    expands it, and then the engine looked for a folder named '~' (fuzz62)."""
    settings = load_settings(["--model", "~/models/x"], {})
    assert settings.engine.model == str(Path.home() / "models" / "x")


@pytest.mark.parametrize("flag, value, says", [
    ("--block-size", "1000000", "block_size must be at most 256"),
    ("--max-header-bytes", "1", "max_header_bytes must be at least 1024"),
    ("--num-threads", "100000", "num_threads must be at most 1024"),
])  # fmt: skip
def test_values_that_leave_the_server_unusable_are_refused(flag, value, says):
    """A 1,000,000-token block took twice the KV budget and a slow start; a 1-byte header
    limit answered every request, /health included, with 431; 100,000 threads aborted the
    engine with "Resource temporarily unavailable (src/thread.cpp:241)", which named no
    setting (fuzz62)."""
    with pytest.raises(SettingsError, match=says):
        load_settings([flag, value], {})


def test_a_mistyped_environment_variable_is_named_with_its_likely_setting():
    """TESSERA_MAX_NUM_SEQ=4 was ignored without a word, where the same typo in YAML or on
    the command line is refused (fuzz62)."""
    environ = {"TESSERA_MAX_NUM_SEQ": "4", "TESSERA_MAX_NUM_SEQS": "8", "TESSERA_CACHE_DIR": "/x",
               "TESSERA_VENV": "/v", "TESSERA_TORCH": "torch", "TESSERA_CONFIG": "c.yaml",
               "PATH": "/bin"}  # fmt: skip
    (warning,) = unknown_environment_variables(environ)
    assert "TESSERA_MAX_NUM_SEQ" in warning and "TESSERA_MAX_NUM_SEQS" in warning


def test_a_setting_written_twice_in_one_yaml_mapping_is_refused(tmp_path):
    """The last one won without a word, where the same key at the top and under `engine:`
    is refused (fuzz62)."""
    config = tmp_path / "c.yaml"
    config.write_text("max_num_seqs: 4\nmax_num_seqs: 8\n")
    with pytest.raises(SettingsError, match="'max_num_seqs' is set twice"):
        load_settings(["--config", str(config)], {})
    config.write_text("engine:\n  block_size: 8\n  block_size: 16\n")
    with pytest.raises(SettingsError, match="'block_size' is set twice"):
        load_settings(["--config", str(config)], {})
    # a merge key is no setting written twice (fuzz66)
    config.write_text("base: &base\n  block_size: 8\nengine:\n  <<: *base\n  max_num_seqs: 4\n")
    with pytest.raises(SettingsError, match="unknown setting 'base'"):
        load_settings(["--config", str(config)], {})
