"""Reading a step's sampled tokens waits for that step only (CUDA only).

With overlap scheduling the next step is queued before this one's tokens are read; reading
them must not wait for it (a plain `.tolist()` of the device tensor would: its copy runs
behind everything queued on the stream)."""

from __future__ import annotations

import pytest
import torch

from engine.protocol import SamplingParams
from engine.sampler import Sampler, SamplingRow

SLEEP_CYCLES = 2_000_000_000  # about a second of device time queued after the sample


@pytest.mark.parametrize("logprobs", [None, 2])
def test_result_does_not_wait_for_later_device_work(logprobs):
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 1.0]], device="cuda")
    params = SamplingParams(temperature=0.0, logprobs=logprobs)
    rows = [SamplingRow(params, [0], []), SamplingRow(params, [0], [])]
    pending = Sampler().sample(logits, rows)
    torch.cuda._sleep(SLEEP_CYCLES)  # stands in for the next step, launched ahead
    output = pending.result()
    still_running = not torch.cuda.current_stream().query()
    torch.cuda.synchronize()
    assert output.token_ids == [1, 0]
    assert still_running, "result() waited for device work queued after the sample"
    assert pending.token_ids.tolist() == [1, 0]  # the device copy the next step reads


def test_grammar_masks_apply_on_the_device_as_on_the_host():
    """Structured outputs' bitmasks travel from the host and unpack on the device."""
    from engine.sampler import apply_allowed_tokens

    generator = torch.Generator().manual_seed(0)
    vocab = 151936
    logits = torch.randn(5, vocab, generator=generator)
    words = torch.randint(-(2**31), 2**31 - 1, (5, (vocab + 31) // 32), dtype=torch.int32,
                          generator=generator)  # fmt: skip
    params = SamplingParams(temperature=0.0)
    rows = [SamplingRow(params, [0], [], allowed_tokens=words[i] if i % 2 else None)
            for i in range(5)]  # fmt: skip
    on_host = apply_allowed_tokens(logits, rows)
    on_device = apply_allowed_tokens(logits.cuda(), rows)
    assert torch.equal(on_device.cpu(), on_host)
    assert Sampler().sample(logits.cuda(), rows).result().token_ids == (
        Sampler().sample(logits, rows).result().token_ids
    )


def test_plain_greedy_rows_take_bf16_logits_without_a_float32_copy(monkeypatch):
    """The cast is exact, so the argmax of bf16 logits is the token; a batch of rows that
    only read it skips the [S, V] float32 copy (78 MB a step at batch 128 and 152k tokens).
    A row with logprobs makes the batch cast."""
    logits = (torch.randn(4, 1000, generator=torch.Generator().manual_seed(3)) * 4).bfloat16()
    logits = logits.cuda()
    expected = logits.float().argmax(dim=-1).tolist()
    casts = []
    original_float = torch.Tensor.float
    monkeypatch.setattr(torch.Tensor, "float", lambda t: casts.append(t.shape) or original_float(t))
    greedy = SamplingParams(temperature=0.0)
    rows = [SamplingRow(greedy, [0], []) for _ in range(4)]
    assert Sampler()(logits, rows).token_ids == expected and casts == []
    rows[0] = SamplingRow(SamplingParams(temperature=0.0, logprobs=1), [0], [])
    assert Sampler()(logits, rows).token_ids == expected and casts == [(4, 1000)]


def test_penalties_on_the_device_as_on_the_host_without_a_sync():
    """The sparse penalties (repetition: gather, penalise, scatter over the held tokens;
    presence and frequency: the output occurrences sorted and counted; ids held twice
    included, a token in flight on the device) give the host's values bit for bit, and
    queue no host sync."""
    from engine.penalties import InFlightOutputs, apply_penalties

    generator = torch.Generator().manual_seed(4)
    vocab = 151936
    logits = torch.randn(6, vocab, generator=generator) * 4
    rows = [SamplingRow(SamplingParams(repetition_penalty=1.0 + 0.1 * i,
                                       presence_penalty=0.3 * (i % 3), frequency_penalty=0.2 * i),
                        torch.randint(0, vocab, (300,), generator=generator),
                        torch.randint(0, 50, (i * 7,), generator=generator))
            for i in range(6)]  # fmt: skip
    rows_in_flight, tokens_in_flight = torch.tensor([1, 4, 5]), torch.tensor([3, 3, 151935])
    on_host = apply_penalties(logits, rows, InFlightOutputs(rows_in_flight, tokens_in_flight))
    in_flight = InFlightOutputs(rows_in_flight.cuda(), tokens_in_flight.cuda())
    device_logits = logits.cuda()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        on_device = apply_penalties(device_logits, rows, in_flight)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(on_device.cpu(), on_host)


def test_seeded_rows_draw_in_groups_on_the_device_as_alone_without_a_sync():
    """Seeded rows of one draw shape draw together, each row's noise from its own CUDA
    generator (engine/sampler.py, `_sample_random`): the tokens each draws alone, and
    `sample()` queues no host sync."""
    logits = (torch.randn(6, 151936, generator=torch.Generator().manual_seed(6)) * 3).cuda()
    settings = [dict(top_k=20, top_p=0.8, temperature=0.7)] * 3 + [
        dict(temperature=0.9), dict(temperature=0.9, min_p=0.05), dict(top_k=5)
    ]  # fmt: skip

    def rows() -> list[SamplingRow]:
        return [SamplingRow(SamplingParams(seed=seed, **params), [0], [],
                            torch.Generator(device="cuda").manual_seed(seed))
                for seed, params in enumerate(settings)]  # fmt: skip

    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        pending = Sampler().sample(logits, rows())
    finally:
        torch.cuda.set_sync_debug_mode("default")
    in_batch = pending.result().token_ids
    alone = [Sampler()(logits[i : i + 1], [row]).token_ids[0] for i, row in enumerate(rows())]
    assert in_batch == alone
