"""engine.process_tree: a process and its descendants, killed together, stopped ones too
(a stopped tensor-parallel worker outlived the engine the server killed: fuzz47)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from engine.process_tree import child_pids, descendant_pids, kill_tree

# A child that starts a grandchild, which stops itself; the child prints its pid.
_SCRIPT = """
import subprocess, sys, time
grandchild = subprocess.Popen([sys.executable, "-c",
    "import os, signal, time; os.kill(os.getpid(), signal.SIGSTOP); time.sleep(60)"])
print(grandchild.pid, flush=True)
time.sleep(60)
"""


def _gone(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] == "Z"  # a zombie has exited


def test_kill_tree_kills_a_stopped_grandchild():
    child = subprocess.Popen([sys.executable, "-c", _SCRIPT], stdout=subprocess.PIPE, text=True)
    try:
        grandchild = int(child.stdout.readline())
        assert child_pids(child.pid) == [grandchild]
        assert descendant_pids(os.getpid()).index(child.pid) < descendant_pids(
            os.getpid()).index(grandchild)  # parents first  # fmt: skip
        kill_tree(child.pid)
        child.wait(10)
        deadline = time.monotonic() + 10
        while not _gone(grandchild):
            assert time.monotonic() < deadline, "the stopped grandchild outlived kill_tree"
            time.sleep(0.05)
    finally:
        child.kill()
        child.wait()
        if "grandchild" in locals() and not _gone(grandchild):
            os.kill(grandchild, signal.SIGKILL)


def test_a_process_that_is_gone_has_no_children():
    no_such_pid = 2**22 + 7  # past Linux's largest pid_max
    assert child_pids(no_such_pid) == [] and descendant_pids(no_such_pid) == []
    kill_tree(no_such_pid)  # nothing to kill: no error
