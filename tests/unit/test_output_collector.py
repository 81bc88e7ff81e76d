"""OutputCollector: outputs the consumer has not taken yet are merged, in order."""

from __future__ import annotations

import asyncio

import pytest

from engine.errors import EngineDeadError
from engine.protocol import FinishReason, RequestOutput, TokenLogprob
from server.output_collector import OutputCollector, merge_outputs


def _output(*token_ids: int, **fields) -> RequestOutput:
    return RequestOutput(request_id="r", new_token_ids=list(token_ids), **fields)


def test_each_output_alone_when_the_consumer_keeps_up():
    async def run():
        collector = OutputCollector()
        got = []
        for token in (1, 2, 3):
            collector.put(_output(token))
            got.append((await collector.get()).new_token_ids)
        return got

    assert asyncio.run(run()) == [[1], [2], [3]]


def test_outputs_waiting_are_merged_in_order():
    async def run():
        collector = OutputCollector()
        collector.put(_output(1, num_prompt_tokens=7, num_cached_tokens=4))
        collector.put(_output(2, 3))
        collector.put(
            _output(4, finish_reason=FinishReason.LENGTH, decode_seconds=0.5, queued_seconds=0.1)
        )
        return await collector.get()

    merged = asyncio.run(run())
    assert merged.new_token_ids == [1, 2, 3, 4]
    assert merged.finish_reason == FinishReason.LENGTH
    assert (merged.num_prompt_tokens, merged.num_cached_tokens) == (7, 4)
    assert (merged.decode_seconds, merged.queued_seconds) == (0.5, 0.1)


def test_logprobs_are_concatenated():
    first = _output(1, logprobs=[TokenLogprob(1, -0.1, [])])
    second = _output(2, logprobs=[TokenLogprob(2, -0.2, [])])
    assert [e.token_id for e in merge_outputs(first, second).logprobs] == [1, 2]
    assert merge_outputs(_output(1), _output(2)).logprobs is None


def test_a_waiting_consumer_wakes_for_the_next_output():
    async def run():
        collector = OutputCollector()
        waiter = asyncio.create_task(collector.get())
        await asyncio.sleep(0)
        assert not waiter.done()
        collector.put(_output(9))
        return await asyncio.wait_for(waiter, 1)

    assert asyncio.run(run()).new_token_ids == [9]


def test_failure_comes_after_the_output_already_waiting():
    async def run():
        collector = OutputCollector()
        collector.put(_output(1))
        collector.fail(EngineDeadError("the engine is not running"))
        first = await collector.get()
        with pytest.raises(EngineDeadError):
            await collector.get()
        waiter = asyncio.create_task(collector.get())  # and again, for a waiting consumer
        with pytest.raises(EngineDeadError):
            await asyncio.wait_for(waiter, 1)
        return first

    assert asyncio.run(run()).new_token_ids == [1]


def test_merged_outputs_keep_one_gap_per_token_after_the_first():
    # inter_token_latency counts generated - 1 gaps per choice, however the tokens were
    # grouped into outputs (a merged backlog may carry the first token with others).
    from server.generation import GenerationTotals

    for groups in ([1, 1, 1, 1, 1], [2, 1, 2], [3, 2], [5]):
        totals = GenerationTotals()
        for size in groups:
            totals.note_tokens(0, size)
        assert len(totals.inter_token_seconds) == 4, groups
        assert totals.num_generated_tokens == totals.choice(0).num_tokens == 5
        assert all(gap >= 0 for gap in totals.inter_token_seconds)


def test_the_prompts_scores_survive_a_merge():
    scores = [TokenLogprob(5, -1.5, [], 2)]
    merged = merge_outputs(_output(1, prompt_logprobs=scores), _output(2))
    assert merged.prompt_logprobs == scores and merged.new_token_ids == [1, 2]


def test_the_consumer_wakes_every_k_tokens_after_the_first_and_at_the_end():
    async def run():
        collector = OutputCollector(tokens_per_wake=3)
        woken = []

        async def consume():
            while True:
                output = await collector.get()
                woken.append(output.new_token_ids)
                if output.finish_reason is not None:
                    return

        consumer = asyncio.create_task(consume())
        for token in range(1, 9):  # 8 tokens; the consumer takes what it is woken for
            finish = FinishReason.LENGTH if token == 8 else None
            collector.put(_output(token, finish_reason=finish))
            await asyncio.sleep(0)
        await asyncio.wait_for(consumer, 1)
        return woken

    # the first token at once (time to first token), then 3 at a time, the rest at the end
    assert asyncio.run(run()) == [[1], [2, 3, 4], [5, 6, 7], [8]]


def test_without_a_token_count_the_consumer_wakes_for_the_first_output_and_the_end():
    async def run():
        collector = OutputCollector(tokens_per_wake=None)
        collector.put(_output(1))
        first = await collector.get()
        for token in (2, 3, 4):
            collector.put(_output(token))
        waiter = asyncio.create_task(collector.get())
        await asyncio.sleep(0)
        assert not waiter.done()  # three tokens wait, and nobody is woken for them
        collector.put(_output(5, finish_reason=FinishReason.STOP))
        return first, await asyncio.wait_for(waiter, 1)

    first, last = asyncio.run(run())
    assert first.new_token_ids == [1] and last.new_token_ids == [2, 3, 4, 5]


def test_a_failure_wakes_a_consumer_below_the_token_count():
    async def run():
        collector = OutputCollector(tokens_per_wake=4)
        collector.put(_output(1))
        await collector.get()
        collector.put(_output(2))
        waiter = asyncio.create_task(collector.get())
        await asyncio.sleep(0)
        assert not waiter.done()
        collector.fail(EngineDeadError("the engine is not running"))
        pending = await asyncio.wait_for(waiter, 1)  # what was produced comes first
        with pytest.raises(EngineDeadError):
            await collector.get()
        return pending

    assert asyncio.run(run()).new_token_ids == [2]
