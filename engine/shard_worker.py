"""The processes of tensor-parallel ranks 1..N-1, and rank 0's handle on them.

Rank 0 (the engine process) starts each worker as `python -m engine.shard_worker` with a
`WorkerSpec` on stdin. (Not multiprocessing: the engine process is a daemonic child of the
server, and daemonic processes may not have children.) A worker

    joins the group -> loads its shard -> waits for ShardSetup (the KV block count rank 0
    sized) -> allocates its KV cache -> barrier -> runs one forward per ShardForward
    until ShardStop

It exits by itself when its parent (the engine process) is gone, and a collective with
a rank that died fails at once (the peer's socket closes), so the engine fails and the
server exits non-zero for its supervisor to restart: no rank outlives the others for long.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import weakref
from pathlib import Path

import msgspec
import torch

from engine.attention import get_attention_backend
from engine.attention.base import AttentionShape
from engine.config import EngineConfig
from engine.errors import EngineBroken
from engine.kv_cache_sizing import allocate_kv_caches
from engine.logging_utils import configure_logging, current_logging, name_this_process
from engine.model_config import ModelConfig
from engine.models.cpu_prepack import can_prepack, prepack_linears
from engine.models.loader import load_model
from engine.tensor_parallel import ShardForward, ShardGroup, ShardSetup, ShardStop

logger = logging.getLogger("tessera.shard_worker")

EXIT_PARENT_GONE = 3  # a worker's exit code once the engine process is gone
POLL_MS = 500  # how often a waiting worker checks that its parent lives
STOP_WAIT_S = 10.0  # how long close() waits for workers to exit before killing them
_DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float8_e4m3fn": torch.float8_e4m3fn,
}


class WorkerSpec(msgspec.Struct):
    config: EngineConfig
    rank: int
    size: int
    store_path: str
    header_addresses: list[str]
    dtype: str  # as rank 0 resolved them, so every rank computes alike
    kv_cache_dtype: str
    parent_pid: int
    log_level: str = "info"
    log_format: str = "text"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


_LIVE: weakref.WeakSet[ShardWorkers] = weakref.WeakSet()  # for kill_all_workers


def kill_all_workers() -> None:
    """SIGKILLs every live worker of this process and removes their folders, waiting on
    nothing: for an engine about to `os._exit` (the step watchdog). A stopped or hung
    worker never gets to its own parent check, and outlived the server."""
    for workers in list(_LIVE):
        workers.kill_now()


class ShardWorkers:
    """Rank 0's side: starts ranks 1..N-1, joins the group with them, stops them.

    `group` is rank 0's `ShardGroup`, for the model's collectives."""

    def __init__(
        self,
        config: EngineConfig,
        dtype: torch.dtype,
        kv_cache_dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        size = config.tensor_parallel_size
        self._dir = tempfile.TemporaryDirectory(prefix="tessera-tp-")  # 0700, private
        store_path = str(Path(self._dir.name) / "store")
        addresses = [f"ipc://{self._dir.name}/rank-{rank}" for rank in range(1, size)]
        log_level, log_format = current_logging()
        env = {**os.environ, "PYTHONPATH": _import_root(os.environ.get("PYTHONPATH"))}
        self._processes: list[subprocess.Popen] = []
        for rank in range(1, size):
            spec = WorkerSpec(
                config=config,
                rank=rank,
                size=size,
                store_path=store_path,
                header_addresses=addresses,
                dtype=dtype_name(dtype),
                kv_cache_dtype=dtype_name(kv_cache_dtype),
                parent_pid=os.getpid(),
                log_level=log_level,
                log_format=log_format,
            )
            process = subprocess.Popen(
                [sys.executable, "-m", "engine.shard_worker"], stdin=subprocess.PIPE, env=env
            )
            process.stdin.write(msgspec.json.encode(spec))
            process.stdin.close()
            self._processes.append(process)
        _LIVE.add(self)
        try:
            self.group = ShardGroup(
                0, size, store_path, addresses, device, peers_alive=self.check_alive
            )
        except BaseException:
            self._kill()
            self._dir.cleanup()
            raise

    def check_alive(self) -> None:
        """Raises EngineBroken once a worker has exited: the engine loop asks on every
        pass, so that an idle server with a dead rank fails (and is restarted) before a
        request finds it out (its /health said ok until then)."""
        for rank, process in enumerate(self._processes, start=1):
            code = process.poll()
            if code is not None:
                raise EngineBroken(f"tensor-parallel rank {rank} exited (code {code})")

    def setup(self, num_kv_blocks: int) -> None:
        """Tells the workers the KV cache size; returns once every rank has allocated it."""
        self.group.send(ShardSetup(num_kv_blocks))
        self.group.barrier()

    def close(self) -> None:
        """Stops the workers (ShardStop, then a kill after STOP_WAIT_S; at once when they
        are out of step, stuck in a forward's collectives where no ShardStop reaches)."""
        try:
            if self.group.out_of_step is not None:
                return
            self.group.send(ShardStop())
            for process in self._processes:
                process.wait(timeout=STOP_WAIT_S)
        except subprocess.TimeoutExpired:
            logger.warning("a tensor-parallel worker did not stop in time; killing it")
        finally:
            self._kill()
            self.group.close()
            self._dir.cleanup()

    def kill_now(self) -> None:
        """SIGKILLs the workers and removes their folder, waiting on nothing."""
        self._kill(wait=False)
        shutil.rmtree(self._dir.name, ignore_errors=True)

    def _kill(self, *, wait: bool = True) -> None:
        for process in self._processes:
            if process.poll() is None:
                process.kill()
                if wait:
                    process.wait()


def _import_root(pythonpath: str | None) -> str:
    """PYTHONPATH that makes this checkout's `engine` importable in a fresh interpreter."""
    root = str(Path(__file__).resolve().parent.parent)
    return root if not pythonpath else f"{root}{os.pathsep}{pythonpath}"


def serve(spec: WorkerSpec) -> int:
    """Runs rank `spec.rank` until ShardStop (0) or its parent is gone (EXIT_PARENT_GONE)."""
    config = spec.config
    device = torch.device("cpu")
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    dtype, kv_cache_dtype = _DTYPES[spec.dtype], _DTYPES[spec.kv_cache_dtype]

    def engine_alive() -> None:
        if _engine_gone(spec.parent_pid):
            raise RuntimeError("the engine process is gone")

    group = ShardGroup(spec.rank, spec.size, spec.store_path, spec.header_addresses, device,
                       peers_alive=engine_alive)  # fmt: skip
    try:
        model = _load(config, group, dtype, kv_cache_dtype, device)
        setup = _next_message(group, spec.parent_pid)
        if not isinstance(setup, ShardSetup):
            return EXIT_PARENT_GONE if setup is None else 1
        kv_caches = allocate_kv_caches(
            model.config, setup.num_kv_blocks + 1, config.block_size, kv_cache_dtype, device
        )
        group.barrier()
        with torch.inference_mode():
            while True:
                message = _next_message(group, spec.parent_pid)
                if message is None:
                    logger.error("rank %d: the engine process is gone; exiting", spec.rank)
                    return EXIT_PARENT_GONE
                if isinstance(message, ShardStop):
                    return 0
                if isinstance(message, ShardForward):
                    inputs = group.receive_forward(message, model.config.hidden_size, dtype)
                    model.model(inputs.embeds, inputs.positions, kv_caches, inputs.metadata)
    finally:
        group.close()


def _load(config: EngineConfig, group: ShardGroup, dtype, kv_cache_dtype, device):
    local = ModelConfig.from_model_dir(config.model).shard(config.tensor_parallel_size)
    shape = AttentionShape.of_model(local, config.block_size, dtype, kv_cache_dtype)
    attention = get_attention_backend(
        config.attention_backend, shape, config.kv_cache_scale, config.kv_cache_scale,
        max_graph_batch=config.max_graph_batch,
    )  # fmt: skip
    model = load_model(
        config.model, dtype=dtype, device=device, attention=attention, tensor_parallel=group
    )
    if can_prepack(device, dtype):  # as rank 0 does
        prepack_linears(model)
    return model


def _engine_gone(parent_pid: int) -> bool:
    """Re-parented (to init or a subreaper): the engine process that started us is gone,
    even by SIGKILL."""
    return os.getppid() != parent_pid


def _next_message(group: ShardGroup, parent_pid: int):
    """The next header from rank 0; None once the parent process is gone."""
    while not group.poll(POLL_MS):
        if _engine_gone(parent_pid):
            return None
    return group.receive()


def main() -> None:
    spec = msgspec.json.decode(sys.stdin.buffer.read(), type=WorkerSpec)
    name_this_process(f"tessera-tp-{spec.rank}")  # in log lines and ps / top
    # A terminal's Ctrl-C and systemd's stop reach the whole process group: rank 0 decides
    # when we stop (an offline LLM's worker died on a Ctrl-C at its caller's prompt).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    configure_logging(spec.log_level, spec.log_format)
    try:
        code = serve(spec)
    except Exception:
        logger.exception("tensor-parallel rank %d failed", spec.rank)
        code = 1
    if _engine_gone(spec.parent_pid):
        # The engine's private folder (the group's store, our socket) is ours to remove
        # once the engine is gone, idle or mid-forward (whose collective then failed): an
        # engine killed with SIGKILL left one in /tmp every time (fuzz33, fuzz38).
        shutil.rmtree(Path(spec.store_path).parent, ignore_errors=True)
    sys.exit(code)


if __name__ == "__main__":
    main()
