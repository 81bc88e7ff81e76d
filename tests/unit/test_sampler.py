"""Sampler: greedy, top-k/top-p/min-p masks, penalties, seeds, logprobs."""

import math

import pytest
import torch

from engine.penalties import InFlightOutputs, apply_penalties
from engine.protocol import SamplingParams
from engine.request import Request
from engine.sampler import Sampler, SamplingRow, apply_top_k_top_p


def row(prompt=(1,), output=(), seed=None, **params) -> SamplingRow:
    sampling = SamplingParams(seed=seed, **params)
    generator = torch.Generator().manual_seed(seed) if seed is not None else None
    return SamplingRow(sampling, list(prompt), list(output), generator)


def test_greedy_is_argmax():
    logits = torch.tensor([[0.1, 2.0, -1.0, 0.5], [3.0, 0.0, 0.0, 0.0]])
    out = Sampler()(logits, [row(temperature=0.0), row(temperature=0.0)])
    assert out.token_ids == [1, 0] and out.logprobs == [None, None]


def test_top_k_and_top_p_masks():
    logits = torch.log(torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05]] * 3))
    params = [SamplingParams(top_k=2), SamplingParams(top_p=0.6), SamplingParams(top_p=0.75)]
    masked = apply_top_k_top_p(logits, params)
    kept = torch.isfinite(masked).tolist()
    assert kept[0] == [True, True, False, False, False]
    assert kept[1] == [True, True, False, False, False]  # 0.5 < 0.6 -> need the second
    assert kept[2] == [True, True, True, False, False]


def test_min_p_and_top_k_restrict_random_samples():
    logits = torch.log(torch.tensor([[0.6, 0.3, 0.05, 0.05]])).repeat(64, 1)
    sampler = Sampler(seed=1)
    out = sampler(logits, [row(min_p=0.2)] * 64)
    assert set(out.token_ids) <= {0, 1} and len(set(out.token_ids)) == 2
    out = sampler(logits, [row(top_k=1)] * 64)
    assert set(out.token_ids) == {0}


def test_top_k_candidates_draw_as_the_whole_vocabulary_does():
    """Rows keeping at most TOP_K_CANDIDATES tokens draw over a top-k of the logits; a row
    without top_k beside them sends the batch over the vocabulary. Both keep the same
    tokens (top_k 3, then the top_p 0.6 nucleus of those: the first two, at 0.714 /
    0.286) and draw them as often."""
    logits = torch.log(torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05]])).repeat(400, 1)
    nucleus = row(top_k=3, top_p=0.6)
    candidates = Sampler(seed=1)(logits, [nucleus] * 400).token_ids
    vocabulary = Sampler(seed=1)(logits, [nucleus] * 399 + [row()]).token_ids[:399]
    for tokens in (candidates, vocabulary):
        assert set(tokens) == {0, 1}
        assert abs(tokens.count(0) / len(tokens) - 0.714) < 0.07


def test_a_top_k_past_the_vocabulary_keeps_every_token():
    logits = torch.zeros(64, 8)
    tokens = Sampler(seed=2)(logits, [row(top_k=20)] * 64).token_ids
    assert set(tokens) == set(range(8))


def test_repetition_penalty_hf_semantics():
    logits = torch.tensor([[2.0, -2.0, 1.0, 1.0]])
    penalized = apply_penalties(logits, [row(prompt=[0], output=[1], repetition_penalty=2.0)])
    assert penalized.tolist() == [[1.0, -4.0, 1.0, 1.0]]


def test_extreme_repetition_penalties_keep_the_logits_finite():
    """1e-39 divided a positive logit to inf (softmax NaN: the sampler drew id 0, a token the
    row never held); 1e39, inf in float32, multiplied a zero logit to NaN."""
    logits = torch.tensor([[0.0, 3.0, 0.5, -1.0, float("-inf")]])
    tiny = apply_penalties(logits, [row(prompt=[1, 2, 3, 4], repetition_penalty=1e-39)])
    assert torch.isfinite(tiny[0, :4]).all() and tiny[0, 4] == float("-inf")
    assert tiny[0, 1] == tiny[0, 2] == 1e30 and tiny[0, 3].item() == pytest.approx(-1e-39)
    huge = apply_penalties(logits, [row(prompt=[0, 1, 3, 4], repetition_penalty=1e39)])
    assert huge[0, 0] == 0.0 and huge[0, 3] == -1e30 and huge[0, 4] == float("-inf")
    for seed in range(5):  # drawn at the smallest random temperature: among the rewarded
        params = row(prompt=[1, 2], repetition_penalty=1e-39, temperature=1e-5)
        assert Sampler(seed=seed)(logits.clone(), [params]).token_ids[0] in (1, 2)


def test_a_huge_penalty_on_every_allowed_token_still_picks_an_allowed_one():
    """Punished past float32, the allowed tokens were -inf like the ones a mask removes:
    the pick fell on token 0, which the row does not allow."""
    from engine.sampler import token_bitmask

    logits = torch.tensor([[2.0, 1.0, -5.0, -4.0, 0.5]])  # -5e38: past float32
    for params in ({"temperature": 0.0}, {"temperature": 1.0, "seed": 3},
                   {"temperature": 1.0, "top_k": 2, "seed": 4}):  # fmt: skip
        punished = SamplingRow(SamplingParams(repetition_penalty=1e38, **params), [2, 3], [],
                               allowed_tokens=token_bitmask([2, 3], 5))  # fmt: skip
        assert Sampler()(logits, [punished]).token_ids[0] in (2, 3), params


def test_a_zero_from_the_noise_generator_never_picks_a_removed_token(monkeypatch):
    """E = 0 made a removed token's 0 / 0 a NaN, and argmax picks NaN: token 0 here,
    which top_k 2 removes (fuzz94; CUDA's exponential_ has drawn zeros, pytorch#20179)."""
    monkeypatch.setattr(torch.Tensor, "exponential_", lambda self, **kw: self.zero_())
    logits = torch.tensor([[0.0, 3.0, 2.0, -1.0]])
    for params in (row(top_k=2), row(top_k=2, seed=5), row(top_p=0.5), row(min_p=0.5)):
        picked = Sampler(seed=1)(logits.clone(), [params]).token_ids[0]
        assert picked == 1, params.params  # the most likely token: every E is the same


def test_top_k_keeps_every_token_tied_with_the_kth_as_transformers_does():
    """A rank cut kept exactly k tokens: of two tied at the k-th place, one was never drawn
    (which one, an accident of the sort)."""
    from transformers import TopKLogitsWarper

    logits = torch.tensor([[3.0, 2.0, 1.0, 2.0, 0.5, 1.0]])
    for top_k in (1, 2, 3, 4):
        expected = torch.isfinite(TopKLogitsWarper(top_k)(None, logits.clone()))
        kept = torch.isfinite(apply_top_k_top_p(logits, [SamplingParams(top_k=top_k)]))
        assert torch.equal(kept, expected), top_k
    many = logits.repeat(600, 1)
    over_candidates = Sampler(seed=1)(many, [row(top_k=2)] * 600).token_ids
    over_vocabulary = Sampler(seed=1)(many, [row(top_k=2)] * 599 + [row()]).token_ids[:599]
    for tokens in (over_candidates, over_vocabulary):  # 0.58 / 0.21 / 0.21
        assert set(tokens) == {0, 1, 3} and min(tokens.count(1), tokens.count(3)) > 80


def dense_repetition_penalty(logits, rows, newest=None):
    """The penalty as a dense mask over [S, V], as the sampler computed it before it
    touched only the tokens a row holds: the reference for that sparse path."""
    seen = torch.zeros_like(logits, dtype=torch.bool)
    for index, sampling_row in enumerate(rows):
        held = [*sampling_row.prompt_token_ids, *sampling_row.output_token_ids]
        if newest is not None and newest[index] is not None:
            held.append(newest[index])
        seen[index, torch.as_tensor(held, dtype=torch.long)] = True
    penalty = torch.tensor([r.params.repetition_penalty for r in rows]).unsqueeze(1)
    penalty = penalty.expand_as(logits)
    return torch.where(seen, torch.where(logits > 0, logits / penalty, logits * penalty), logits)


def test_repetition_penalty_touches_only_held_tokens_as_the_dense_mask_did():
    """Rows with and without a penalty, ids held several times, kept tensors and lists,
    and tokens in flight: bit for bit the dense computation. The caller's logits are left
    as they were unless it hands them over (`in_place`)."""
    generator = torch.Generator().manual_seed(3)
    vocab = 50
    logits = torch.randn(5, vocab, generator=generator) * 4
    logits[:, :3] = 0.0  # zero stays zero either way
    penalties = [1.3, 1.0, 0.7, 2.0, 1.05]
    rows, newest = [], [7, None, 0, 49, None]
    for index, penalty in enumerate(penalties):
        prompt = torch.randint(0, vocab, (20 + index,), generator=generator)
        output = torch.randint(0, vocab, (index * 3,), generator=generator).tolist()
        if index % 2:
            prompt = prompt.tolist()
        rows.append(SamplingRow(SamplingParams(repetition_penalty=penalty), prompt, output))
    in_flight = InFlightOutputs(torch.tensor([0, 2, 3]), torch.tensor([7, 0, 49]))
    before = logits.clone()
    penalized = apply_penalties(logits, rows, in_flight)
    assert torch.equal(logits, before)
    assert torch.equal(penalized, dense_repetition_penalty(logits, rows, newest))
    assert not torch.equal(penalized, dense_repetition_penalty(logits, rows))
    assert apply_penalties(logits, rows, in_flight, in_place=True) is logits
    assert torch.equal(logits, penalized)


def test_presence_and_frequency_penalties_over_output_only():
    logits = torch.zeros(1, 4)
    sampling_row = row(prompt=[3], output=[1, 1, 2], presence_penalty=0.5, frequency_penalty=0.25)
    penalized = apply_penalties(logits, [sampling_row])
    assert penalized.tolist() == [[0.0, -1.0, -0.75, 0.0]]


def test_a_token_in_flight_counts_as_an_output():
    """With overlap scheduling a row's newest token is still on the device: penalised as if
    it were in `output_token_ids` already (rows 0 and 2 have one in flight, row 1 none)."""
    logits = torch.randn(3, 6, generator=torch.Generator().manual_seed(0))
    params = dict(repetition_penalty=1.7, presence_penalty=0.5, frequency_penalty=0.25)
    known = [row(prompt=[5], output=[1, 2], **params), row(output=[3], **params),
             row(prompt=[0], **params)]  # fmt: skip
    caught_up = [row(prompt=[5], output=[1, 2, 2], **params), row(output=[3], **params),
                 row(prompt=[0], output=[4], **params)]  # fmt: skip
    in_flight = InFlightOutputs(torch.tensor([0, 2]), torch.tensor([2, 4]))
    expected = apply_penalties(logits, caught_up)
    assert torch.equal(apply_penalties(logits, known, in_flight), expected)
    assert not torch.equal(apply_penalties(logits, known), expected)


def test_a_seeded_request_draws_on_the_device_that_samples_it():
    """One generator per seeded request, made on the sampling device at its first sample
    and kept after (preemption does not restart its stream); none without a seed. A host
    stream cost ~2 ms of CPU a row and step at a 152k vocabulary, plus a copy."""
    request = Request("r", [1, 2], SamplingParams(seed=5, temperature=1.0))
    generator = request.generator_on(torch.device("cpu"))
    assert generator is not None and generator.device == torch.device("cpu")
    assert request.generator_on(torch.device("cpu")) is generator
    assert Request("s", [1], SamplingParams()).generator_on(torch.device("cpu")) is None


@pytest.mark.parametrize("seed", [5, 2**31, -1, -(2**63), 2**63 - 1])
def test_cpu_seeds_2_to_the_32_apart_draw_differently(seed):
    """torch's CPU generator keeps a seed's low 32 bits: seeds 2**32 apart drew alike
    (fuzz78). The high half is mixed in; a seed below 2**32 draws as torch's own."""

    def draws(seed: int) -> torch.Tensor:
        request = Request("r", [1], SamplingParams(seed=seed, temperature=1.0))
        return torch.rand(8, generator=request.generator_on(torch.device("cpu")))

    others = [s for s in (seed + 2**32, seed - 2**32, seed + 2**33) if -(2**63) <= s < 2**63]
    assert all(not torch.equal(draws(seed), draws(other)) for other in others)
    if 0 <= seed < 2**32:
        assert torch.equal(
            draws(seed), torch.rand(8, generator=torch.Generator().manual_seed(seed))
        )


def test_engine_seeds_2_to_the_32_apart_draw_differently_on_cpu():
    """The engine-wide --seed (unseeded requests) had the same 32-bit cut (fuzz80)."""
    cpu = torch.device("cpu")
    draws = [torch.rand(8, generator=Sampler(seed)._generator(cpu)) for seed in (7, 7 + 2**32)]
    assert not torch.equal(*draws)
    assert torch.equal(draws[0], torch.rand(8, generator=torch.Generator().manual_seed(7)))


def dense_presence_and_frequency(logits, rows, newest=None):
    """OpenAI's penalties through a dense [S, V] count of the outputs, as the sampler
    computed them before it touched only the tokens a row has output: the reference."""
    counts = torch.zeros_like(logits)
    for index, sampling_row in enumerate(rows):
        outputs = [*sampling_row.output_token_ids]
        if newest is not None and newest[index] is not None:
            outputs.append(newest[index])
        for token in outputs:
            counts[index, token] += 1
    presence = torch.tensor([r.params.presence_penalty for r in rows]).unsqueeze(1)
    frequency = torch.tensor([r.params.frequency_penalty for r in rows]).unsqueeze(1)
    penalised = logits - frequency * counts
    return penalised - presence * (counts > 0).to(logits.dtype)


def test_presence_and_frequency_touch_only_output_tokens_as_the_dense_count_did():
    """Rows with and without the penalties, tokens output many times, kept tensors and
    lists, tokens in flight (named on the host or not), -inf and zero logits: bit for bit
    the dense computation, the caller's logits untouched."""
    generator = torch.Generator().manual_seed(5)
    vocab = 40
    logits = torch.randn(5, vocab, generator=generator) * 4
    logits[:, :2] = 0.0
    logits[1, 5] = float("-inf")
    settings = [(0.5, 0.25), (0.0, 0.0), (-0.3, 1.1), (1.7, 0.0), (0.0, -0.6)]
    rows, newest = [], [3, 5, None, 0, 39]
    for index, (presence, frequency) in enumerate(settings):
        output = torch.randint(0, vocab // 4, (6 * index,), generator=generator)
        if index % 2:
            output = output.tolist()
        params = SamplingParams(presence_penalty=presence, frequency_penalty=frequency)
        rows.append(SamplingRow(params, [1, 2, 3], output))
    rows[1] = SamplingRow(SamplingParams(), [1], [5, 5])
    in_flight_rows, in_flight_ids = torch.tensor([0, 1, 3, 4]), torch.tensor([3, 5, 0, 39])
    want = dense_presence_and_frequency(logits, rows, newest)
    assert not torch.equal(want, dense_presence_and_frequency(logits, rows))
    before = logits.clone()
    for rows_host in ((), (0, 1, 3, 4)):
        in_flight = InFlightOutputs(in_flight_rows, in_flight_ids, rows_host)
        assert torch.equal(apply_penalties(logits, rows, in_flight), want)
    assert torch.equal(logits, before)


def test_rows_with_their_requests_read_the_device_table_as_the_lists():
    """A request's rows read their tokens from the sampler's table (written once, appended
    after each sample); every penalty together, through several steps, tokens in flight
    (step 3 samples while step 2's tokens of rows 0 and 2 are not on the host yet) and a
    finished request, gives the logits that the host's lists give."""
    from engine.request import RequestStatus

    generator = torch.Generator().manual_seed(1)
    settings = [dict(repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=0.2),
                dict(presence_penalty=0.9), dict(frequency_penalty=-0.5),
                dict(repetition_penalty=0.8), dict()]  # fmt: skip
    requests = []
    for index, params in enumerate(settings):
        request = Request(f"r{index}", [7, index, index + 1, 7], SamplingParams(**params))
        request.status, request.num_pending_tokens = RequestStatus.RUNNING, 1
        requests.append(request)
    sampler, device = Sampler(), torch.device("cpu")
    in_flight, flying = None, {}  # request -> its token not yet on the host
    for step in range(6):
        logits = torch.randn(len(requests), 12, generator=generator)
        on_table = [SamplingRow(r.sampling, r.prompt_token_ids, r.output_token_ids,
                                request=r) for r in requests]  # fmt: skip
        on_lists = [SamplingRow(r.sampling, r.prompt_token_ids, list(r.output_token_ids))
                    for r in requests]  # fmt: skip
        held_rows = sampler._held_rows(on_table, device, in_flight)
        got = apply_penalties(logits, on_table, in_flight, held_rows=held_rows)
        assert torch.equal(got, apply_penalties(logits, on_lists, in_flight)), step
        sampled = got.argmax(dim=-1).tolist()
        sampler._held[device].append(held_rows, torch.tensor(sampled))
        for request, token in flying.items():  # the step before is read now
            request.output_token_ids.append(token)
            request.num_pending_tokens = 1
        flying, in_flight = {}, None
        for request, token in zip(requests, sampled, strict=True):
            if step == 2 and request in (requests[0], requests[2]):
                flying[request] = token
                request.num_pending_tokens = 2
            else:
                request.output_token_ids.append(token)
        if flying:
            in_flight = InFlightOutputs(torch.tensor([0, 2]), torch.tensor([*flying.values()]),
                                        (0, 2))  # fmt: skip
        if step == 4:
            requests[1].status = RequestStatus.FINISHED_STOPPED
            requests = requests[:1] + requests[2:]
    assert sampler._held[device].num_slots_in_use == 3


def test_the_table_refuses_tokens_in_flight_on_rows_it_cannot_name():
    """The table holds its rows' tokens in flight; counting in-flight tokens again on top
    needs to know their rows on the host, or a row's token would count twice. The sampler
    then reads the rows' ids instead of the table."""
    from engine.request import RequestStatus

    request = Request("r", [4, 5], SamplingParams(frequency_penalty=0.5))
    request.status, request.num_pending_tokens = RequestStatus.RUNNING, 1
    rows = [SamplingRow(request.sampling, [4, 5], [], request=request)]
    sampler, device = Sampler(), torch.device("cpu")
    held_rows = sampler._held_rows(rows, device, None)
    unnamed = InFlightOutputs(torch.tensor([0]), torch.tensor([3]))
    with pytest.raises(ValueError, match="rows_host"):
        apply_penalties(torch.zeros(1, 8), rows, unnamed, held_rows=held_rows)
    assert sampler._held_rows(rows, device, unnamed) is None


def test_seeded_rows_draw_in_groups_of_one_shape_each_as_alone(monkeypatch):
    """Seeded rows draw together where they would each draw the same way alone (top-k
    candidates of one width, or the vocabulary; a top-p cut or not), with each row's noise
    from its own stream: one draw per group, not per row, and every seeded row's tokens,
    step after step, those it draws alone. Unseeded rows draw together from the engine's
    stream."""
    import engine.sampler as sampler_module

    logits = torch.randn(9, 300, generator=torch.Generator().manual_seed(4)) * 2
    settings = [dict(top_k=20, top_p=0.8, temperature=0.7)] * 3 + [
        dict(top_k=20, temperature=0.7),  # no top-p cut: its own group
        dict(top_k=5, top_p=0.8),  # another width
        dict(temperature=0.9), dict(temperature=1.3, min_p=0.1),  # the vocabulary
    ]  # fmt: skip
    seeds = [11, 12, 13, 14, 15, 16, 17]
    unseeded = [row(temperature=0.5), row(temperature=0.0)]

    def batch():
        return [row(seed=seed, **params) for seed, params in zip(seeds, settings, strict=True)]

    draws = []
    real_draw = sampler_module._draw
    monkeypatch.setattr(sampler_module, "_draw", lambda logits, params, generator:
                        draws.append(len(params)) or real_draw(logits, params, generator))  # fmt: skip
    together, sampler = batch(), Sampler(seed=5)
    in_batch = [sampler(logits, [*together, *unseeded]).token_ids[:7] for _ in range(5)]
    assert draws == [9, 3, 1, 1, 2] * 5  # the whole batch (its unseeded rows), 4 groups
    alone = []
    for index, seeded in enumerate(batch()):
        alone.append([Sampler()(logits[index : index + 1], [seeded]).token_ids[0]
                      for _ in range(5)])  # fmt: skip
    assert in_batch == [list(step) for step in zip(*alone, strict=True)]
    assert len({tuple(tokens) for tokens in alone}) > 1


def test_a_seed_on_some_rows_changes_nothing_for_the_others(monkeypatch):
    """Beside seeded rows, the others draw as in a batch without seeds: the whole batch
    draws from the engine's stream, and only the seeded rows' logits are copied for their
    own draws (copying 127 of 128 rows of 152k for the unseeded ones took 31 ms a step on
    one CPU thread)."""
    logits = torch.randn(6, 500, generator=torch.Generator().manual_seed(8)) * 2
    plain = [row(temperature=0.9) for _ in range(6)]
    mixed = list(plain)
    mixed[2], mixed[5] = row(seed=4, temperature=0.9), row(seed=9, top_k=5)
    copied = []
    real_index_select = torch.Tensor.index_select
    monkeypatch.setattr(torch.Tensor, "index_select", lambda t, dim, index:
                        copied.append(index.numel() if t.shape[-1] == 500 else 0)
                        or real_index_select(t, dim, index))  # fmt: skip
    without_seeds = Sampler(seed=1)(logits, plain).token_ids
    copied.clear()
    with_seeds = Sampler(seed=1)(logits, mixed).token_ids
    assert [with_seeds[i] for i in (0, 1, 3, 4)] == [without_seeds[i] for i in (0, 1, 3, 4)]
    assert sum(copied) == 2  # rows of logits copied: the two seeded rows


def test_top_k_one_is_greedy_without_the_random_path(monkeypatch):
    """top_k 1 leaves one candidate: the argmax of the processed logits (penalties and
    biases applied), taken without sorting, softmax and noise over the vocabulary, which
    Qwen2-VL's defaults (top_k 1, top_p 0.001, temperature 0.01) made every request pay."""
    qwen_defaults = dict(top_k=1, top_p=0.001, temperature=0.01)
    assert SamplingParams(**qwen_defaults).is_greedy
    assert not SamplingParams(top_k=2, temperature=0.01).is_greedy
    monkeypatch.setattr(Sampler, "_sample_random", lambda *a: pytest.fail("sampled randomly"))
    logits = torch.tensor([[0.0, 3.0, 2.9, 1.0], [5.0, 1.0, 1.0, 0.0]])
    rows = [row(output=[1], repetition_penalty=2.0, **qwen_defaults),
            row(logit_bias=((3, 10.0),), **qwen_defaults)]  # fmt: skip
    assert Sampler()(logits, rows).token_ids == [2, 3]


def test_seeded_rows_do_not_depend_on_batch():
    torch.manual_seed(0)
    logits = torch.randn(4, 50)
    alone = Sampler()(logits[2:3], [row(seed=7)]).token_ids[0]
    seeded = row(seed=7)
    batch = [row(), row(temperature=0.0), seeded, row(top_p=0.9)]
    in_batch = Sampler(seed=123)(logits, batch).token_ids[2]
    assert in_batch == alone
    # A top-k row alone draws over its candidates; beside a row without top_k the batch
    # draws over the vocabulary: the seeded row's tokens stay its own either way.
    draws = [row(seed=5, top_k=20) for _ in range(3)]
    alone = [Sampler()(logits[:1], [draws[0]]).token_ids[0] for _ in range(6)]
    beside_top_k = [Sampler()(logits[:2], [draws[1], row(top_k=4)]).token_ids[0]
                    for _ in range(6)]  # fmt: skip
    beside_full = [Sampler()(logits[:2], [draws[2], row()]).token_ids[0] for _ in range(6)]
    assert alone == beside_top_k == beside_full and len(set(alone)) > 1
    # the same seed reproduces a whole sequence of draws
    a, b = row(seed=3), row(seed=3)
    first = [Sampler(seed=9)(logits[:1], [a]).token_ids[0] for _ in range(5)]
    second = [Sampler(seed=10)(logits[:1], [b]).token_ids[0] for _ in range(5)]
    assert first == second and len(set(first)) > 1


def test_logprobs_from_raw_logits():
    logits = torch.tensor([[1.0, 2.0, 3.0, 0.0]])
    out = Sampler()(logits, [row(temperature=0.0, logprobs=2, repetition_penalty=5.0, prompt=[2])])
    expected = torch.log_softmax(logits, -1)[0]
    (token_logprob,) = out.logprobs
    assert token_logprob.token_id == out.token_ids[0]
    assert math.isclose(token_logprob.logprob, expected[out.token_ids[0]].item(), rel_tol=1e-6)
    assert [t for t, _ in token_logprob.top] == [2, 1]
    assert math.isclose(token_logprob.top[0][1], expected[2].item(), rel_tol=1e-6)
    # repetition penalty on token 2 (3.0 / 5 = 0.6) makes token 1 the greedy pick
    assert out.token_ids == [1]


def test_temperature_sampling_follows_distribution():
    logits = torch.log(torch.tensor([[0.7, 0.3]])).repeat(4000, 1)
    out = Sampler(seed=0)(logits, [row(temperature=1.0)] * 4000)
    share = sum(1 for t in out.token_ids if t == 0) / 4000
    assert 0.66 < share < 0.74


def test_logit_bias_steers_greedy_and_random_rows_of_its_request_only():
    logits = torch.tensor([[0.25, 2.0, -1.0, 0.5]]).repeat(4, 1)
    rows = [
        row(temperature=0.0, logit_bias=((2, 100.0),)),  # forces token 2
        row(temperature=0.0, logit_bias=((1, -100.0),)),  # bans the argmax: token 3 next
        row(temperature=1.0, logit_bias=((0, 100.0), (1, -100.0))),
        row(temperature=0.0),  # no bias: the batch's biases do not reach it
    ]
    assert Sampler(seed=5)(logits, rows).token_ids == [2, 3, 0, 1]
    # The logprobs stay those of the raw logits, as for the penalties.
    out = Sampler()(logits[:1], [row(temperature=0.0, logprobs=0, logit_bias=((2, 100.0),))])
    expected = torch.log_softmax(logits[0], -1)[2].item()
    assert out.token_ids == [2] and math.isclose(out.logprobs[0].logprob, expected, rel_tol=1e-6)
    assert logits[0].tolist() == [0.25, 2.0, -1.0, 0.5]  # not modified in place


def test_greedy_rows_pick_the_same_token_from_bf16_logits(monkeypatch):
    """bf16 logits, on a CPU: cast to float32 first, also for plain greedy rows (a CPU's
    bf16 argmax is not vectorised; a GPU skips the cast for them, which
    tests/gpu/test_sampler_cuda.py checks), and the token is the one from float32 logits,
    for greedy rows and for rows that compute with the logits."""
    logits = (torch.randn(4, 1000, generator=torch.Generator().manual_seed(3)) * 4).bfloat16()
    logits[1, 7] = logits[1, 9] = logits[1].max() + 1  # a tie: the first index, both ways
    expected = logits.float().argmax(dim=-1).tolist()
    casts = []
    original_float = torch.Tensor.float
    monkeypatch.setattr(torch.Tensor, "float", lambda t: casts.append(t.shape) or original_float(t))
    greedy = [row(temperature=0.0) for _ in range(4)]
    assert Sampler()(logits, greedy).token_ids == expected
    assert casts == [(4, 1000)] and expected[1] == 7
    casts.clear()

    for computing in (
        {"logprobs": 2},
        {"repetition_penalty": 1.3},
        {"logit_bias": ((5, 3.0),)},
        {"temperature": 0.8, "seed": 11},
    ):
        params = {"temperature": 0.0, **computing}
        from_bf16 = Sampler(seed=5)(logits, [row(**params), *greedy[1:]])
        assert casts == [(4, 1000)]
        casts.clear()
        from_float32 = Sampler(seed=5)(original_float(logits), [row(**params), *greedy[1:]])
        assert from_bf16 == from_float32


def test_a_tiny_temperature_is_greedy():
    """As vLLM: below 1e-5 a row is greedy. 1e-40 used to overflow the scaled logits to inf
    (softmax NaN) and pick token 0."""
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(8)) * 5
    rows = [row(temperature=t, seed=1) for t in (1e-40, 1e-6, 0.0)]
    assert Sampler()(logits, rows).token_ids == logits.argmax(dim=-1).tolist()
