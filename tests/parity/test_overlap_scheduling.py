"""Overlap scheduling (EngineCore.step_overlapped): step N+1 is scheduled and launched
before step N's sampled tokens are read, its decode rows taking N's tokens on the device.

On CPU a launched step has already run, but the engine is told it overlaps (as on CUDA),
so the same code runs: pending tokens in the scheduler, placeholder rows filled from the
previous step's token tensor, a speculative row for a request that N's token stops. The
outputs must be those of the plain step-by-step loop (which tests/parity/test_generate.py
holds equal to transformers): greedy and seeded tokens equal, logprobs within float32
noise (a speculative row changes a step's batch shape), finish reasons equal, and no KV
block left held.
"""

from __future__ import annotations

import time

import msgspec
import numpy as np
import pytest
import torch
from PIL import Image

from engine import LLM, SamplingParams
from engine.scheduler import Scheduler
from engine.tiny_model import make_tiny_model

WORDS = "the quick brown fox jumps over the lazy dog again and again".split()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("overlap"), seed=5)


def image_chat(text: str) -> dict:
    pixels = (np.arange(56 * 84 * 3).reshape(56, 84, 3) * 5) % 253
    image = Image.fromarray(pixels.astype(np.uint8))
    content = [{"type": "image", "image": image}, {"type": "text", "text": text}]
    return {"messages": [{"role": "user", "content": content}]}


def prompts(count: int) -> list:
    texts = [" ".join(WORDS[: 2 + 2 * i]) for i in range(count - 1)]
    return [image_chat("What is it?"), *texts]


def greedy(max_tokens: int, **extra) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=2, **extra)


def generate(model_dir, prompts, params, *, overlap: bool, graphs: bool = False, **options):
    """Results, the number of steps launched ahead, and the run's preemptions."""
    llm = LLM(str(model_dir), dtype="float32", **options)
    core = llm.engine
    core.overlaps_steps = overlap
    if graphs:
        core.runner.enable_decode_graphs(use_cuda_graphs=False)
    launched_ahead = []
    real_launch = core.launch_step

    def launch_step(previous=None):
        launched_ahead.append(previous is not None)
        return real_launch(previous)

    core.launch_step = launch_step
    results = llm.generate(prompts, params)
    assert not core.has_unfinished_requests()
    assert core.scheduler.kv.usage == 0  # every block back, speculative rows included
    assert all(r.num_pending_tokens == 0 for r in core.scheduler.requests.values())
    preemptions = sum(stats.num_preemptions_total for stats in llm.last_stats)
    return results, sum(launched_ahead), preemptions


def assert_same_outputs(got, want) -> None:
    for have, expected in zip(got, want, strict=True):
        assert have.error is None, have.error
        assert have.token_ids == expected.token_ids
        assert have.finish_reason == expected.finish_reason
        if expected.logprobs is not None:
            torch.testing.assert_close(
                [lp.logprob for lp in have.logprobs],
                [lp.logprob for lp in expected.logprobs],
                atol=1e-4,
                rtol=0,
            )


def stopping_params(model_dir, batch) -> list[SamplingParams]:
    """Different lengths, seeded random rows, and stop tokens taken from a first greedy run,
    so requests stop on their first token (right after prefill), mid-way, or by length."""
    plain = [greedy(6 + 3 * i, ignore_eos=True) for i in range(len(batch))]
    first, _, _ = generate(model_dir, batch, plain, overlap=False)
    params = list(plain)
    params[1] = msgspec.structs.replace(plain[1], stop_token_ids=(first[1].token_ids[0],))
    params[2] = msgspec.structs.replace(plain[2], stop_token_ids=(first[2].token_ids[3],))
    params[3] = SamplingParams(max_tokens=9, temperature=0.8, top_p=0.9, seed=7, logprobs=1)
    params[4] = SamplingParams(max_tokens=1, temperature=0.0)  # done at its prefill
    return params


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graph-path"])
def test_overlapped_steps_equal_plain_steps(model_dir, graphs):
    batch = prompts(7)
    params = stopping_params(model_dir, batch)
    want, ahead, _ = generate(model_dir, batch, params, overlap=False)
    assert ahead == 0
    got, ahead, _ = generate(model_dir, batch, params, overlap=True, graphs=graphs)
    assert ahead > 10  # most steps were launched before the previous one was read
    assert_same_outputs(got, want)
    assert got[1].finish_reason == "stop" and len(got[1].token_ids) == 1
    assert got[2].finish_reason == "stop" and len(got[2].token_ids) <= 4


def test_chunked_prefill_preemption_and_prefix_cache(model_dir):
    """A tight KV pool (preemption, with tokens in flight), 4-token blocks that fill on
    in-flight tokens, shared prefixes and prefill chunks of 16 tokens."""
    batch = prompts(6) + prompts(6)[1:4]  # repeats: prefix-cache hits
    params = [greedy(10 + 2 * i, ignore_eos=True) for i in range(len(batch))]
    options = dict(num_kv_blocks=24, block_size=4, max_num_batched_tokens=16)
    want, _, _ = generate(model_dir, batch, params, overlap=False, **options)
    got, ahead, preemptions = generate(model_dir, batch, params, overlap=True, **options)
    assert ahead > 10
    assert preemptions > 0
    assert_same_outputs(got, want)


def test_penalties_overlap_and_count_the_token_in_flight(model_dir):
    """Penalties read the output so far; the sampler counts the token still in flight on
    the device, so such steps overlap and still equal the plain loop's. (Qwen2-VL and
    Qwen2.5-VL checkpoints set repetition_penalty 1.05, applied by default: before, none
    of their steps overlapped.)"""
    batch = prompts(4)
    params = [
        greedy(12, ignore_eos=True, repetition_penalty=1.5, frequency_penalty=0.5),
        greedy(24, ignore_eos=True),
        greedy(24, ignore_eos=True, presence_penalty=1.0),
        # Rewards for repeating: the token just written (in flight, in the overlapped run)
        # decides the next one, so leaving it uncounted changes the answer.
        greedy(24, ignore_eos=True, repetition_penalty=0.5, frequency_penalty=-2.0),
    ]
    want, _, _ = generate(model_dir, batch, params, overlap=False)
    unpenalized, _, _ = generate(model_dir, batch, [greedy(p.max_tokens, ignore_eos=True)
                                                    for p in params], overlap=False)  # fmt: skip
    for row in (0, 2, 3):  # the penalties bite
        assert want[row].token_ids != unpenalized[row].token_ids
    got, ahead, _ = generate(model_dir, batch, params, overlap=True)
    assert_same_outputs(got, want)
    assert ahead > 15


def test_bad_words_of_several_tokens_sit_out_steps_launched_ahead(model_dir, monkeypatch):
    """Which bad word's last token to ban depends on the tokens just written, on the host:
    such a request is never scheduled while its token is in flight, so it takes every
    other step, while the request beside it keeps overlapping. Both answer as in the plain
    loop. (Grammars take the same path: tests/parity/test_structured_output_parity.py.)"""
    batch = prompts(2)
    first, _, _ = generate(model_dir, batch, greedy(12, ignore_eos=True), overlap=False)
    word = tuple(first[0].token_ids[2:4])  # written by the plain run: banned, it changes
    params = [greedy(12, ignore_eos=True, bad_words_token_ids=(word,)),
              greedy(12, ignore_eos=True)]  # fmt: skip
    want, _, _ = generate(model_dir, batch, params, overlap=False)
    assert want[0].token_ids != first[0].token_ids
    samples_with_a_token_in_flight = []
    real_schedule = Scheduler.schedule

    def schedule(self):
        output = real_schedule(self)
        samples_with_a_token_in_flight.extend(
            chunk.request.request_id for chunk in output.chunks
            if chunk.samples and chunk.request.num_pending_tokens > 1
        )  # fmt: skip
        return output

    monkeypatch.setattr(Scheduler, "schedule", schedule)
    got, ahead, _ = generate(model_dir, batch, params, overlap=True)
    assert_same_outputs(got, want)
    assert ahead >= 8  # the plain request's steps still overlap
    assert samples_with_a_token_in_flight  # the plain request decodes ahead of its token
    assert got[0].request_id not in samples_with_a_token_in_flight  # the bad words never


def test_overlap_scheduling_setting_turns_it_off(model_dir):
    batch = prompts(2)
    params = greedy(8, ignore_eos=True)
    _, ahead, _ = generate(model_dir, batch, params, overlap=True, overlap_scheduling=False)
    assert ahead == 0


def test_the_device_table_of_held_tokens_penalises_as_the_host_ids_do(model_dir, monkeypatch):
    """The penalties read each request's tokens from the sampler's device table
    (engine/held_tokens.py: written once, appended each step on the device). Through
    preemption (a tight KV pool), prefill chunks, tokens in flight and finished requests
    whose slots are reused, they must penalise as the host's ids do (the table turned off:
    every step's ids built from the requests' lists). Rewards for repeating (repetition
    penalty 0.5, a negative presence penalty) and a strong frequency penalty make any
    token missing from, or counted twice in, the table change the answer. Each request's ids are written from the host
    once, at its first sample: preemption keeps its slot, and each step's token is appended
    on the device."""
    from engine.held_tokens import HeldTokens
    from engine.sampler import Sampler

    batch = prompts(6) + prompts(6)[1:4]
    params = [greedy(10 + 2 * i, ignore_eos=True, repetition_penalty=0.5 if i % 2 else 1.7)
              for i in range(len(batch))]  # fmt: skip
    params[2] = greedy(14, ignore_eos=True)  # no penalty beside them
    for i in (0, 3, 6):  # OpenAI's penalties too, which count the outputs
        params[i] = msgspec.structs.replace(params[i], presence_penalty=0.6, frequency_penalty=2.0)
    params[4] = greedy(18, ignore_eos=True, presence_penalty=-1.0, frequency_penalty=0.5)
    options = dict(num_kv_blocks=24, block_size=4, max_num_batched_tokens=16)
    indexed, written = [], []
    real_index, real_write = HeldTokens.index, HeldTokens._write
    monkeypatch.setattr(HeldTokens, "index", lambda self, rows, *rest: indexed.append(len(rows))
                        or real_index(self, rows, *rest))  # fmt: skip
    monkeypatch.setattr(HeldTokens, "_write", lambda self, slot, ids: written.append(slot)
                        or real_write(self, slot, ids))  # fmt: skip
    for overlap in (False, True):
        got, _, preemptions = generate(model_dir, batch, params, overlap=overlap, **options)
        assert preemptions > 0 and sum(indexed) > 50
        assert len(written) == len(batch) - 1  # once per request with the penalty
        with monkeypatch.context() as without_table:
            without_table.setattr(Sampler, "_held_rows", lambda *args: None)
            want, _, _ = generate(model_dir, batch, params, overlap=overlap, **options)
        assert_same_outputs(got, want)
        indexed.clear()
        written.clear()


def test_step_times_do_not_count_a_step_launched_ahead_twice(model_dir):
    """Overlapped, a step is launched before the one in flight has finished; its time runs
    from when that one finishes, so that step times add up to the engine's time (each used
    to count the rest of the step before it too: ~2x the run's wall time on CPU, where a
    launch runs the step)."""
    llm = LLM(str(model_dir), dtype="float32")
    llm.engine.overlaps_steps = True
    llm.generate(prompts(1), greedy(2))  # warm-up
    started = time.perf_counter()
    llm.generate(prompts(4), greedy(24, ignore_eos=True))
    wall = time.perf_counter() - started
    assert sum(stats.step_seconds for stats in llm.last_stats) <= wall
    assert sum(stats.step_seconds for stats in llm.last_stats) > 0.25 * wall
