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


def test_engine_host_times_admitting_image_requests(capsys):
    from bench.engine_host import main

    assert main(["--batch", "2", "--prompt-len", "10", "--steps", "2", "--admit-images", "3"]) == 0
    line = capsys.readouterr().out.splitlines()[-1]
    assert line.startswith("add_request of 3 image requests: ") and line.endswith(" ms each")
    assert float(line.split(": ")[1].split()[0]) > 0
