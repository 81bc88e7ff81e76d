"""A process and what it started: listed from Linux /proc, and killed together.

The server SIGKILLs an engine process that did not stop when asked. The engine's own
children (tensor-parallel workers, engine/shard_worker.py) watch for their parent to
vanish, but a worker that is stopped or wedged never looks: after the engine was killed it
outlived the server for good (fuzz47). Whoever kills the engine kills its descendants
with it. Elsewhere than Linux (no /proc) only the process itself is known.
"""

from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path


def child_pids(pid: int) -> list[int]:
    """The direct children of process `pid`, from every one of its threads (Linux /proc;
    none elsewhere, or once it is gone)."""
    children = []
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except FileNotFoundError:
        return []
    for task in tasks:
        try:
            listed = (task / "children").read_text()
        except FileNotFoundError:  # the thread ended since the listing (a worker thread)
            continue
        children += [int(child) for child in listed.split()]
    return children


def descendant_pids(pid: int) -> list[int]:
    """Every process `pid` started, and those they started, parents first."""
    found: list[int] = []
    pending = child_pids(pid)
    while pending:
        child = pending.pop(0)
        if child not in found:
            found.append(child)
            pending += child_pids(child)
    return found


def kill_tree(pid: int) -> None:
    """SIGKILL `pid` and its descendants (listed first: once `pid` is gone its children
    are re-parented and can no longer be told apart). A stopped process dies too."""
    for target in [pid, *descendant_pids(pid)]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(target, signal.SIGKILL)
