"""bench/engine_host.py on a tiny batch: it reports every phase and leaves the engine's
classes as they were (it wraps their methods only while it measures)."""

from __future__ import annotations

from engine.kv_cache_manager import KVCacheManager
from engine.scheduler import Scheduler


def test_engine_host_reports_phases_and_restores_methods(capsys):
    from bench.engine_host import main

    originals = (Scheduler.schedule, Scheduler.update, KVCacheManager.allocate_slots)
    assert main(["--batch", "3", "--prompt-len", "20", "--steps", "4"]) == 0
    assert (Scheduler.schedule, Scheduler.update, KVCacheManager.allocate_slots) == originals
    report = capsys.readouterr().out
    for label in ("step", "forward", "host", "schedule", "allocate_slots", "gather", "update"):
        line = next(line for line in report.splitlines() if line.split()[:1] == [label])
        assert float(line.split()[1]) > 0, line
