"""`tessera serve` checks the model folder's files before the engine loads the weights
(minutes on a GPU): a broken file is one line and exit 1 at once. Each of these loaded the
weights first and then failed with tracebacks (exit 3), or started and failed every
request, or started on a wrong setting."""

from __future__ import annotations

import json
import shutil
import socket
from pathlib import Path

import pytest
import torch

from engine.tiny_model import make_tiny_model
from server.cli import main


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("preflight"), seed=4)


def broken_copy(tiny: Path, tmp_path: Path, change) -> Path:
    folder = tmp_path / "model"
    shutil.copytree(tiny, folder)
    change(folder)
    return folder


def serve(capsys, folder: Path | str, *args: str) -> tuple[int, str]:
    """`tessera serve` on a port already taken: a folder the check misses then fails at
    once ("cannot listen"), not with a server that runs on."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        port = taken.getsockname()[1]
        code = main(["serve", "--model", str(folder), "--port", str(port), *args])
    return code, capsys.readouterr().err


def write(name: str, text: str):
    return lambda folder: (folder / name).write_text(text)


def edit_config(**changes):
    def change(folder: Path) -> None:
        config = json.loads((folder / "config.json").read_text())
        config.update(changes)
        (folder / "config.json").write_text(json.dumps(config))

    return change


def truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


@pytest.mark.parametrize("change, words", [
    (write("tokenizer.json", "{not json"), "tokenizer.json"),
    (write("tokenizer_config.json", "{not json"), "tokenizer_config.json"),
    (lambda folder: ((folder / "chat_template.jinja").unlink(missing_ok=True),
                     (folder / "chat_template.json").write_text("{not json")),
     "chat_template.json"),
    (write("preprocessor_config.json", "{not json"), "preprocessor_config.json"),
    (lambda folder: (folder / "preprocessor_config.json").unlink(), "preprocessor_config.json"),
    (write("chat_template.jinja", "{% for m in messages %}{{ m.content }"), "chat template"),
    (write("config.json", "[]"), "config.json"),
    (edit_config(num_attention_heads=0), "config.json"),
    (edit_config(text_config=[1]), "config.json"),
    (write("model.safetensors", ""), "model.safetensors is not a valid safetensors file"),
    (lambda folder: truncate(folder / "model.safetensors"), "model.safetensors is not a valid"),
    (edit_config(max_position_embeddings=0), "max_position_embeddings 0 is not positive"),
    (edit_config(num_attention_heads=8), "mrope_section (4, 6, 6) does not sum"),
    (edit_config(num_attention_heads=6), "does not divide hidden_size"),
])  # fmt: skip
def test_a_broken_model_folder_fails_before_the_engine_starts(
    tiny, tmp_path, capsys, change, words
):
    code, err = serve(capsys, broken_copy(tiny, tmp_path, change))
    assert code == 1 and words in err, err
    assert "Traceback" not in err and "engine" not in err.lower()


def test_a_model_folder_that_does_not_exist_is_named_whole(tmp_path, capsys):
    missing = tmp_path / "no" / "such" / "model"
    code, err = serve(capsys, missing)
    assert code == 1 and str(missing) in err and "does not exist" in err


def test_a_context_longer_than_the_model_was_trained_for_is_refused(tiny, capsys):
    """vLLM refuses it too: positions past the trained ones give wrong answers."""
    trained = json.loads((tiny / "config.json").read_text()).get("max_position_embeddings")
    code, err = serve(capsys, tiny, "--max-model-len", str(trained + 1))
    assert code == 2 and "max_position_embeddings" in err


def test_a_tensor_parallel_size_the_model_cannot_split_into_is_refused_at_once(tiny, capsys):
    """It was refused in the engine process, after it had started."""
    heads = json.loads((tiny / "config.json").read_text())["num_attention_heads"]
    code, err = serve(capsys, tiny, "--tensor-parallel-size", str(heads + 1))
    assert code == 2 and "num_attention_heads" in err, err
    assert "Traceback" not in err and "engine" not in err.lower()


def test_tensor_parallelism_on_a_gpu_is_refused_at_once(tiny, capsys, monkeypatch):
    """The gloo ranks run on CPU only; on a GPU the engine refused it after it had started
    (exit 1, fuzz84). The check is the same on any non-CPU device, so a CPU machine tests
    it by resolving the device as CUDA."""
    import server.preflight

    monkeypatch.setattr(server.preflight, "_device", lambda engine: torch.device("cuda"))
    code, err = serve(capsys, tiny, "--tensor-parallel-size", "2")
    assert code == 2 and "tensor_parallel_size" in err and "CPU (gloo) only" in err, err
    assert "Traceback" not in err


def test_an_expected_engine_start_up_failure_is_logged_without_a_traceback(caplog):
    """Every ModelLoadError (no config.json, unsupported architecture, a missing shard)
    came with a full stack trace before the one-line reason; a bug still gets one."""
    import logging
    import os

    from engine.config import EngineConfig
    from engine.errors import ModelLoadError
    from engine.process import _serve

    def refused(config):
        raise ModelLoadError("unsupported architecture 'Nope'")

    def broken(config):
        raise KeyError("a bug")

    config = EngineConfig(model="unused")
    with caplog.at_level(logging.ERROR):
        assert _serve(config, [], [], os.getpid(), refused) != 0
        assert _serve(config, [], [], os.getpid(), broken) != 0
    expected, bug = [r for r in caplog.records if "start-up failed" in r.getMessage()]
    assert "unsupported architecture 'Nope'" in expected.getMessage()
    assert expected.exc_info is None and bug.exc_info is not None


def test_an_engine_address_in_use_is_one_line(tiny, capsys):
    """A second server given the same --engine-inbox-address ended in a ZMQError
    traceback."""
    import zmq

    context = zmq.Context()
    taken = context.socket(zmq.PULL)
    port = taken.bind_to_random_port("tcp://127.0.0.1")
    free_ports = []
    for _ in range(2):  # the HTTP port must be free here: it is taken first
        with socket.socket() as free:
            free.bind(("127.0.0.1", 0))
            free_ports.append(free.getsockname()[1])
    try:
        code = main(["serve", "--model", str(tiny), "--host", "127.0.0.1",
                     "--port", str(free_ports[0]),
                     "--engine-inbox-address", f"tcp://127.0.0.1:{port}",
                     "--engine-outbox-address", f"tcp://127.0.0.1:{free_ports[1]}"])  # fmt: skip
        err = capsys.readouterr().err
    finally:
        taken.close(linger=0)
        context.term()
    assert code == 1 and "cannot bind the engine sockets" in err, err
    assert "Traceback" not in err


def refused_setting(capsys, folder: Path, *args: str) -> str:
    """A setting this machine cannot run is a settings mistake: exit 2 and one line, before
    the engine starts. Each started the engine, which failed ~10 s later with a traceback
    and exit 1, the code that asks a supervisor to restart the server (fuzz62)."""
    code, err = serve(capsys, folder, *args)
    assert code == 2, err
    assert err.startswith("tessera serve: error: ") and err.count("\n") == 1, err
    return err


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without CUDA")
@pytest.mark.parametrize("device", ["cuda", "cuda:1"])
def test_a_cuda_device_without_cuda_is_refused(tiny, capsys, device):
    err = refused_setting(capsys, tiny, "--device", device)
    assert f"device {device}: no CUDA device is available (set by --device)" in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without CUDA")
def test_a_refused_device_names_where_it_was_set(tiny, capsys, monkeypatch, tmp_path):
    """It said `--device cuda` when the environment or a YAML file had set it, and the user
    looked for a flag they never gave (fuzz62)."""
    monkeypatch.setenv("TESSERA_DEVICE", "cuda")
    err = refused_setting(capsys, tiny)
    assert "device cuda: no CUDA device is available (set by TESSERA_DEVICE)" in err
    monkeypatch.delenv("TESSERA_DEVICE")
    (config := tmp_path / "c.yaml").write_text("num_kv_blocks: 10000000000\n")
    err = refused_setting(capsys, tiny, "--device", "cpu", "--config", str(config))
    assert "more than this machine has" in err and f"(set by {config})" in err


def test_a_cuda_device_past_the_last_one_is_refused(tiny, capsys, monkeypatch):
    if not torch.cuda.is_available():  # a machine with one GPU, as far as the check can tell
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    count = torch.cuda.device_count()
    err = refused_setting(capsys, tiny, "--device", f"cuda:{count}")
    assert f"device cuda:{count}: this machine has {count} CUDA device(s)" in err


def test_flashinfer_on_a_cpu_is_refused(tiny, capsys):
    err = refused_setting(capsys, tiny, "--device", "cpu", "--attention-backend", "flashinfer")
    assert "attention_backend 'flashinfer' needs a CUDA device" in err


def test_a_kv_cache_bigger_than_the_machines_memory_is_refused(tiny, capsys):
    err = refused_setting(capsys, tiny, "--device", "cpu", "--num-kv-blocks", "10000000000")
    assert "num_kv_blocks=10000000000 needs" in err and "more than this machine has" in err
    # One that fits passes the check, and fails only at the taken port.
    code, err = serve(capsys, tiny, "--device", "cpu", "--num-kv-blocks", "4")
    assert code == 1 and "cannot listen" in err, err


def cgroups(monkeypatch, root: Path, listing: str, files: dict[str, str]) -> None:
    """A /proc/self/cgroup of `listing` over a cgroup mount at `root` holding `files`."""
    from engine import kv_cache_sizing

    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    (root / "self_cgroup").write_text(listing)
    monkeypatch.setattr(kv_cache_sizing, "PROC_SELF_CGROUP", str(root / "self_cgroup"))
    monkeypatch.setattr(kv_cache_sizing, "CGROUP_ROOT", str(root / "cgroup"))


@pytest.mark.parametrize("listing, files", [
    # v2, the limit on a parent of the process's own cgroup (a systemd slice)
    ("0::/app.slice/tessera.service\n", {"cgroup/app.slice/memory.max": f"{1 << 20}\n",
                                         "cgroup/app.slice/tessera.service/memory.max": "max\n",
                                         "cgroup/memory.max": "max\n"}),
    # v1, nested as on this project's development machine
    ("4:memory:/process_api/x\n0::/\n", {
        "cgroup/memory/process_api/x/memory.limit_in_bytes": f"{1 << 20}\n",
        "cgroup/memory/memory.limit_in_bytes": "9223372036854771712\n"}),
])  # fmt: skip
def test_a_kv_cache_bigger_than_the_cgroups_memory_limit_is_refused(
    tiny, capsys, monkeypatch, tmp_path, listing, files
):
    """The check read the machine's memory: in a container or unit limited to less, a KV
    cache between the two passed, and the kernel killed the engine as the cache filled.
    Then it read only the mount's top files, not the process's own cgroup (fuzz74)."""
    cgroups(monkeypatch, tmp_path, listing, files)
    err = refused_setting(capsys, tiny, "--device", "cpu", "--num-kv-blocks", "1000")
    assert "more than this container's memory limit is (1.0 MiB)" in err, err


def test_no_cgroup_limit_leaves_the_machines_memory(tiny, capsys, monkeypatch, tmp_path):
    cgroups(monkeypatch, tmp_path, "4:memory:/x\n0::/\n", {
        "cgroup/memory/x/memory.limit_in_bytes": "9223372036854771712\n",
        "cgroup/memory.max": "max\n"})  # fmt: skip
    code, err = serve(capsys, tiny, "--device", "cpu", "--num-kv-blocks", "1000")
    assert code == 1 and "cannot listen" in err, err


def test_a_kv_cache_too_big_or_damaged_weights_in_the_engine_are_one_line(caplog):
    """What the pre-flight check does not see (an offline LLM, a GPU's free memory) still
    reached the engine process's log with a traceback."""
    import logging
    import os

    from safetensors import SafetensorError

    from engine.config import EngineConfig
    from engine.kv_cache_sizing import MemoryBudgetError
    from engine.process import _serve

    def too_big(config):
        raise MemoryBudgetError("num_kv_blocks=9 needs 9 bytes of KV cache")

    def damaged(config):
        raise SafetensorError("Error while deserializing header: header too small")

    config = EngineConfig(model="unused")
    with caplog.at_level(logging.ERROR):
        assert _serve(config, [], [], os.getpid(), too_big) != 0
        assert _serve(config, [], [], os.getpid(), damaged) != 0
    records = [r for r in caplog.records if "start-up failed" in r.getMessage()]
    assert [r.getMessage() for r in records] == [
        "engine start-up failed: num_kv_blocks=9 needs 9 bytes of KV cache",
        "engine start-up failed: Error while deserializing header: header too small",
    ]
    assert all(r.exc_info is None for r in records)


def test_a_context_or_split_this_model_cannot_take_is_a_settings_mistake(tiny, capsys, monkeypatch):
    """They were exit 1, the code that asks a supervisor to restart, and named no flag,
    variable or file (fuzz74)."""
    err = refused_setting(capsys, tiny, "--max-model-len", "10000000")
    assert "max_model_len 10000000 is longer than" in err and "(set by --max-model-len)" in err
    monkeypatch.setenv("TESSERA_TENSOR_PARALLEL_SIZE", "3")
    err = refused_setting(capsys, tiny)
    assert "does not divide" in err and "(set by TESSERA_TENSOR_PARALLEL_SIZE)" in err


def test_a_cgroup_listing_line_of_another_shape_is_skipped(monkeypatch, tmp_path):
    from engine.kv_cache_sizing import cgroup_memory_limit

    cgroups(monkeypatch, tmp_path, "not a cgroup line\n0::/\n", {"cgroup/memory.max": "4096\n"})
    assert cgroup_memory_limit() == 4096
