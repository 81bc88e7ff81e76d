"""server/fair_pool.py: owners take turns on the threads, an owner alone uses them all,
a job cancelled while queued never runs, and errors reach their caller."""

from __future__ import annotations

import asyncio
import threading

import pytest

from server.fair_pool import FairPool


def test_a_free_thread_goes_to_the_owner_with_the_fewest_jobs_running():
    order: list[str] = []
    gates = {name: threading.Event() for name in ("a0", "a1", "a2", "a3", "b0", "b1", "c0")}

    def job(name: str) -> str:
        order.append(name)
        gates[name].wait(5)
        return name

    async def until(count: int) -> None:
        for _ in range(500):
            if len(order) >= count:
                return
            await asyncio.sleep(0.01)

    async def scenario():
        pool = FairPool(2, "test")
        try:
            tasks = [asyncio.create_task(pool.run("a", job, f"a{i}")) for i in range(4)]
            await until(2)
            tasks += [asyncio.create_task(pool.run("b", job, f"b{i}")) for i in range(2)]
            tasks.append(asyncio.create_task(pool.run("c", job, "c0")))
            await asyncio.sleep(0.05)
            assert order == ["a0", "a1"]  # alone, a took both threads
            # One thread free at a time: b and c (none running) go before a's third ...
            for finished, count in (("a0", 3), ("a1", 4), ("b0", 5)):
                gates[finished].set()
                await until(count)
            assert order == ["a0", "a1", "b0", "c0", "a2"]  # ... then the least served
            for gate in gates.values():
                gate.set()
            return await asyncio.gather(*tasks)
        finally:
            for gate in gates.values():
                gate.set()
            pool.shutdown()

    results = asyncio.run(scenario())
    assert results == ["a0", "a1", "a2", "a3", "b0", "b1", "c0"]


def test_a_job_cancelled_while_queued_never_runs():
    ran: list[str] = []
    gate = threading.Event()

    def job(name: str) -> None:
        ran.append(name)
        gate.wait(5)

    async def scenario():
        pool = FairPool(1, "test")
        try:
            first = asyncio.create_task(pool.run("a", job, "first"))
            queued = asyncio.create_task(pool.run("b", job, "queued"))
            await asyncio.sleep(0.05)
            queued.cancel()
            gate.set()
            await first
            await pool.run("c", job, "after")
        finally:
            pool.shutdown()

    asyncio.run(scenario())
    assert ran == ["first", "after"]


def test_an_error_reaches_its_caller_and_frees_the_thread():
    def fail() -> None:
        raise ValueError("bad image")

    async def scenario():
        pool = FairPool(1, "test")
        try:
            with pytest.raises(ValueError, match="bad image"):
                await pool.run("a", fail)
            return await pool.run("a", lambda: 7)
        finally:
            pool.shutdown()

    assert asyncio.run(scenario()) == 7


def test_owners_are_forgotten_once_they_have_nothing_left():
    """An owner whose queued job was cancelled (a request that left or failed) stayed in
    the pool's bookkeeping for the life of the process (fuzz74)."""
    gate = threading.Event()

    async def scenario():
        pool = FairPool(1, "test")
        try:
            first = asyncio.create_task(pool.run("a", gate.wait, 5))  # a runs one job...
            left = asyncio.create_task(pool.run("a", lambda: None))  # ... and queues one
            await asyncio.sleep(0.05)
            left.cancel()  # its request left
            gate.set()
            await first
            await pool.run("c", lambda: None)
            return pool._served, pool._running, pool._queues
        finally:
            pool.shutdown()

    assert asyncio.run(scenario()) == ({}, {}, {})


def test_shutdown_cancels_the_queued_jobs():
    """They never finished, and their callers waited for ever (fuzz74)."""
    gate = threading.Event()

    async def scenario():
        pool = FairPool(1, "test")
        running = asyncio.create_task(pool.run("a", gate.wait, 5))
        queued = asyncio.create_task(pool.run("b", lambda: "never"))
        await asyncio.sleep(0.05)
        pool.shutdown()
        gate.set()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(queued, 2)
        assert await running is True
        with pytest.raises(RuntimeError, match="shut down"):
            await pool.run("c", lambda: None)

    asyncio.run(scenario())


def test_a_job_raising_what_a_future_refuses_does_not_stop_the_pool():
    """A StopIteration (which an asyncio future refuses) ended the callback before the
    next job started: every other request's decode waited for ever (fuzz74)."""

    def stop() -> None:
        raise StopIteration

    async def scenario():
        pool = FairPool(1, "test")
        try:
            failing = asyncio.create_task(pool.run("a", stop))
            after = asyncio.create_task(pool.run("b", lambda: "ran"))
            with pytest.raises(RuntimeError, match="StopIteration"):
                await asyncio.wait_for(failing, 2)
            return await asyncio.wait_for(after, 2)
        finally:
            pool.shutdown()

    assert asyncio.run(scenario()) == "ran"
