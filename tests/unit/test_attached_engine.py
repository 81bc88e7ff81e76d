"""AttachedEngine: an API process watching an engine that its launcher started and reaps
(server/engine_client.py). A zombie is an engine that has exited."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from server.attached_engine import AttachedEngine, is_running

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


def test_a_running_process_is_alive_and_a_zombie_is_not():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert is_running(child.pid)
        assert AttachedEngine(child.pid, launcher_pid=os.getppid()).is_alive()
        child.kill()
        deadline = time.monotonic() + 5
        while is_running(child.pid):  # not reaped yet: a zombie until wait() below
            assert time.monotonic() < deadline, "a killed, unreaped child still counts as running"
            time.sleep(0.01)
        stat = Path(f"/proc/{child.pid}/stat").read_text()
        assert stat.rsplit(")", 1)[1].split()[0] == "Z"  # it was the zombie branch
    finally:
        child.kill()
        child.wait()
    assert not is_running(child.pid)  # reaped: no such process


def test_the_engine_counts_as_gone_once_the_launcher_is():
    engine = AttachedEngine(os.getpid(), launcher_pid=os.getppid() + 1)  # not our parent
    assert not engine.is_alive()
    assert "launcher" in engine.describe_exit()
