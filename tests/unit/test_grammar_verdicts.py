"""server/sampling_params.py `_GrammarVerdicts`: the remembered answers of grammar checks
(an LRU of a fixed size, a hit moved to its end) and the one check that concurrent
requests with the same spec share, which a failed check is not remembered from. Mutation
testing found the bound, the eviction order and the single flight unpinned."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from server import sampling_params


class CountingCheck:
    """Stands in for `_grammar_verdict`: records each spec it checks, answers "bad <spec>"
    for a spec starting with "bad" (and the spec as the engine's), and, while `gate` is
    clear, blocks (on a check thread, as llguidance does) so that requests pile up on one
    check."""

    def __init__(self) -> None:
        self.specs: list[str] = []
        self.gate = threading.Event()
        self.gate.set()
        self.fail_next = False

    def __call__(self, spec: str) -> tuple[str | None, str]:
        self.specs.append(spec)
        self.gate.wait(10)
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("llguidance crashed")
        return (f"bad {spec}" if spec.startswith("bad") else None), spec


@pytest.fixture
def check(monkeypatch) -> CountingCheck:
    counting = CountingCheck()
    monkeypatch.setattr(sampling_params, "_grammar_verdict", counting)
    pool = ThreadPoolExecutor(4, thread_name_prefix="test-grammar-check")
    monkeypatch.setattr(sampling_params, "_grammar_checks", pool)
    yield counting
    counting.gate.set()
    pool.shutdown(wait=True)


def verdicts_of(verdicts: sampling_params._GrammarVerdicts, *specs: str) -> list:
    async def main():
        return [await verdicts.check(spec) for spec in specs]

    return asyncio.run(main())


def test_the_verdicts_kept_never_outnumber_the_capacity_and_the_oldest_goes(check):
    """Unbounded, the verdicts would keep every schema a client ever sent; 256 are kept
    (each a digest and up to 500 characters). The oldest goes first, so the newest is kept
    (evicting it would check the schema just seen again)."""
    verdicts = sampling_params._GrammarVerdicts(2)
    assert verdicts_of(verdicts, "a", "bad b", "c") == [None, "bad bad b", None]
    assert len(verdicts._verdicts) == 2
    assert verdicts_of(verdicts, "c", "bad b") == [None, "bad bad b"]  # both kept
    assert check.specs == ["a", "bad b", "c"]
    assert verdicts_of(verdicts, "a") == [None]  # the oldest was evicted: checked again
    assert check.specs == ["a", "bad b", "c", "a"]
    assert len(verdicts._verdicts) == 2


def test_a_capacity_of_n_keeps_exactly_n_verdicts(check):
    """Not one fewer: a bound evicting at the capacity itself would check again a schema
    that the LRU has room for."""
    verdicts = sampling_params._GrammarVerdicts(3)
    verdicts_of(verdicts, "a", "b", "c", "a", "b", "c")
    assert check.specs == ["a", "b", "c"]  # three fit: none checked twice
    verdicts_of(verdicts, "d", "a")
    assert check.specs == ["a", "b", "c", "d", "a"]


def test_a_verdict_looked_up_again_is_the_last_to_be_evicted(check):
    """A popular schema, asked for again and again, would be evicted as the oldest insert
    while schemas seen once stay: each hit moves it to the LRU's end."""
    verdicts = sampling_params._GrammarVerdicts(2)
    verdicts_of(verdicts, "popular", "once", "popular", "new")  # "new" evicts "once"
    assert check.specs == ["popular", "once", "new"]
    verdicts_of(verdicts, "popular")
    assert check.specs == ["popular", "once", "new"]  # still remembered
    verdicts_of(verdicts, "once")
    assert check.specs == ["popular", "once", "new", "once"]


def test_concurrent_requests_with_one_new_spec_share_one_check(check):
    """A burst of requests carrying the same large schema each ran llguidance (0.3 s
    apiece on two threads, fuzz53): the first starts the check, the others wait for it.
    Another spec in the same burst gets its own check."""
    verdicts = sampling_params._GrammarVerdicts(8)
    check.gate.clear()

    async def main():
        same = [asyncio.create_task(verdicts.check("bad s")) for _ in range(6)]
        other = asyncio.create_task(verdicts.check("t"))
        await asyncio.sleep(0.05)  # every request is waiting on a check by now
        check.gate.set()
        return await asyncio.gather(*same), await other

    same, other = asyncio.run(main())
    assert same == ["bad bad s"] * 6 and other is None
    assert sorted(check.specs) == ["bad s", "t"]


def test_a_request_that_leaves_does_not_cancel_the_check_the_others_wait_for(check):
    """The check is shared: a client that disconnects while it runs cancels its own wait,
    never the check, or every other request with that schema would fail with it."""
    verdicts = sampling_params._GrammarVerdicts(8)
    check.gate.clear()

    async def main():
        leaving = asyncio.create_task(verdicts.check("s"))
        staying = [asyncio.create_task(verdicts.check("s")) for _ in range(3)]
        await asyncio.sleep(0.05)
        leaving.cancel()
        await asyncio.sleep(0)
        check.gate.set()
        return await asyncio.gather(*staying)

    assert asyncio.run(main()) == [None] * 3
    assert check.specs == ["s"]
    verdicts_of(verdicts, "s")
    assert check.specs == ["s"]  # remembered, though its first asker left


def test_a_check_that_raised_is_shared_by_its_waiters_but_not_remembered(check):
    """A crash of the checker is no verdict on the schema: every request that waited on
    that check gets the error, and the next request with the spec checks it again."""
    verdicts = sampling_params._GrammarVerdicts(8)
    check.gate.clear()
    check.fail_next = True

    async def main():
        waiters = [asyncio.create_task(verdicts.check("s")) for _ in range(3)]
        await asyncio.sleep(0.05)
        check.gate.set()
        return await asyncio.gather(*waiters, return_exceptions=True)

    errors = asyncio.run(main())
    assert [type(e) for e in errors] == [RuntimeError] * 3 and check.specs == ["s"]
    assert verdicts._verdicts == {} and verdicts._in_flight == {}
    assert verdicts_of(verdicts, "s", "s") == [None, None]
    assert check.specs == ["s", "s"]  # checked again once, then remembered
