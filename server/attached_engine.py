"""An engine process that an API process watches but did not start: with several API
processes (server/api_servers.py) the launcher starts and reaps the engine, and each API
process knows it by pid alone."""

from __future__ import annotations

import os
from pathlib import Path


class AttachedEngine:
    """An engine process started and reaped by the launcher, our parent. It counts as
    alive while its pid runs (a zombie has exited) and while the launcher lives: the
    engine exits when the launcher is gone."""

    def __init__(self, pid: int, *, launcher_pid: int):
        self.pid = pid
        self.launcher_pid = launcher_pid

    def is_alive(self) -> bool:
        return os.getppid() == self.launcher_pid and is_running(self.pid)

    def describe_exit(self) -> str:
        if os.getppid() != self.launcher_pid:
            return f"the launcher (process {self.launcher_pid}) is gone"
        return f"engine process {self.pid} exited"


def is_running(pid: int) -> bool:
    """Whether `pid` is a live process of ours (not a zombie, not another user's)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else (pid reuse): not our engine
        return False
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:  # exited since the kill(0), or no /proc (not Linux)
        return not Path("/proc/self").exists()  # no /proc: kill(0) found it
    return stat.rsplit(")", 1)[1].split()[0] != "Z"
