"""Starting and stopping an OpenAI-compatible server for a benchmark run (not a test).

`running(spec, port, log_dir, timeout_s)` starts the server in its own process group on
127.0.0.1, waits until `/health` and `/v1/models` answer, yields its base URL and stops it
on the way out (SIGTERM to the group, SIGKILL after a grace period). Used by
bench/side_by_side.py (Tessera vs vLLM's CPU build) and bench/gpu_serving.py;
`tiny_server` starts this checkout's server the way the small benchmarks want it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import httpx

from engine.process_tree import child_pids

REPO_ROOT = Path(__file__).resolve().parent.parent


def repo_pythonpath(repo: Path = REPO_ROOT) -> str:
    """PYTHONPATH for a server started from a checkout (this one by default): the repo
    first, then whatever the caller had (on the offline GPU machine, the folder the wheel
    bundle went to)."""
    inherited = os.environ.get("PYTHONPATH")
    return os.pathsep.join([str(repo), inherited] if inherited else [str(repo)])


HOST = "127.0.0.1"


@dataclass(frozen=True)
class ServerSpec:
    """How to start one server: its command line and extra environment."""

    name: str
    command: list[str]
    env: dict[str, str]
    cwd: Path = REPO_ROOT  # `python -m` imports from here first


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return sock.getsockname()[1]


def wait_healthy(base_url: str, process: subprocess.Popen, timeout_s: float, log: Path) -> None:
    deadline = time.monotonic() + timeout_s
    with httpx.Client(base_url=base_url, timeout=5.0, trust_env=False) as http:
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise RuntimeError(f"server exited with {process.returncode}; log: {log}")
            with contextlib.suppress(httpx.HTTPError):
                if http.get("/health").status_code == 200:
                    models = http.get("/v1/models")
                    if models.status_code in (200, 401):  # 401: up, and keyed (--api-key)
                        return
            time.sleep(1.0)
    raise RuntimeError(f"server not healthy after {timeout_s:.0f} s; log: {log}")


def stop(process: subprocess.Popen, grace_s: float = 30.0) -> None:
    """SIGTERM the server's process group (engine workers included), SIGKILL if it lingers."""
    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(grace_s)
        except subprocess.TimeoutExpired:
            pass
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)  # stragglers of the group, if any
    process.wait()


@contextlib.contextmanager
def running(spec: ServerSpec, port: int, log_dir: Path, timeout_s: float) -> Iterator[str]:
    with started(spec, port, log_dir, timeout_s) as (base_url, _):
        yield base_url


@contextlib.contextmanager
def started(
    spec: ServerSpec, port: int, log_dir: Path, timeout_s: float
) -> Iterator[tuple[str, subprocess.Popen]]:
    """Like `running`, and also yields the server's process (for its pid)."""
    log = log_dir / f"{spec.name}.log"
    print(f"[{spec.name}] starting: {' '.join(spec.command)}  (log {log})", file=sys.stderr)
    start = time.monotonic()
    with open(log, "wb") as log_file:
        process = subprocess.Popen(
            spec.command,
            cwd=spec.cwd,
            env={**os.environ, **spec.env},
            stdout=log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: stop() reaches its children
        )
    base_url = f"http://{HOST}:{port}"
    try:
        wait_healthy(base_url, process, timeout_s, log)
        print(f"[{spec.name}] healthy after {time.monotonic() - start:.0f} s", file=sys.stderr)
        yield base_url, process
    finally:
        stop(process)


TINY_MODEL_NAME = "tiny"  # the name `tiny_server` serves its model under
# The small benchmarks' and e2e tests' server: media URLs on 127.0.0.1, a fixed KV pool.
TINY_SERVER_FLAGS = (
    "--allow-private-media-urls", "--num-kv-blocks", "512", "--max-model-len", "2048",
)  # fmt: skip


@contextlib.contextmanager
def tiny_server(
    model_dir: Path,
    log: Path,
    *extra: str,
    engine_threads: int | None = None,
    repo: Path = REPO_ROOT,
    env: Mapping[str, str] | None = None,
) -> Iterator[tuple[str, subprocess.Popen]]:
    """`python -m server.cli serve` from `repo` (this checkout by default; another one for
    a baseline) on `model_dir` (served as TINY_MODEL_NAME) on a free port with `extra`
    flags, logging to `log` (a `.log` file); yields (base URL, process). `engine_threads`
    sets OMP_NUM_THREADS (one leaves the other core to the client). It takes no API key
    from the caller's environment (its clients send none); pass `--api-key` for one.
    `env`: more environment variables for the server."""
    if log.suffix != ".log":
        raise ValueError(f"the server log must be a .log file, got {log}")
    port = free_port()
    command = [
        sys.executable, "-m", "server.cli", "serve", "--model", str(model_dir),
        "--host", HOST, "--port", str(port), "--served-model-name", TINY_MODEL_NAME, *extra,
    ]  # fmt: skip
    variables = {"PYTHONPATH": repo_pythonpath(repo), "TESSERA_API_KEY": "none", **(env or {})}
    if engine_threads is not None:
        variables["OMP_NUM_THREADS"] = str(engine_threads)
    spec = ServerSpec(log.stem, command, variables, cwd=repo)
    with started(spec, port, log.parent, 180.0) as server:
        yield server


def cpu_seconds(pid: int, thread_id: int | None = None) -> float:
    """User + system CPU time so far of process `pid`, or of its thread `thread_id` (the
    OS thread id, `threading.Thread.native_id`) (Linux /proc)."""
    stat = f"/proc/{pid}/stat" if thread_id is None else f"/proc/{pid}/task/{thread_id}/stat"
    fields = Path(stat).read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def process_name(pid: int) -> str:
    """What `ps -o comm` shows (Tessera names its processes: engine/logging_utils.py)."""
    return Path(f"/proc/{pid}/comm").read_text().strip()


def server_processes(server_pid: int) -> tuple[int, list[int]]:
    """(engine pid, API process pids) of a running `tessera serve` (Linux /proc): the API
    process is the server itself, or with --api-server-count > 1 its tessera-api-N
    children."""
    children = child_pids(server_pid)
    names = {child: process_name(child) for child in children}
    engines = [child for child, name in names.items() if name == "tessera-engine"]
    if len(engines) != 1:
        raise RuntimeError(f"no single engine process among the children {names}")
    api = sorted(child for child, name in names.items() if name.startswith("tessera-api-"))
    return engines[0], api or [server_pid]


def engine_pid(server_pid: int) -> int:
    """The engine process among the server's children."""
    return server_processes(server_pid)[0]
