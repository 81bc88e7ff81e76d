"""The sampler's device table of each request's tokens (engine/held_tokens.py)."""

from __future__ import annotations

import torch

from engine.held_tokens import MIN_SLOTS, MIN_WIDTH, HeldTokens
from engine.protocol import SamplingParams
from engine.request import Request, RequestStatus


def sampling_request(request_id: str, prompt: list[int]) -> Request:
    """A request about to sample (the scheduler counts the token as pending)."""
    request = Request(request_id, prompt, SamplingParams(repetition_penalty=1.5))
    request.status = RequestStatus.RUNNING
    request.num_pending_tokens = 1
    return request


def held_ids(held: HeldTokens, requests: list[Request]) -> list[list[int]]:
    """Each request's row as the penalty reads it, padding (its first token) dropped."""
    rows = held.index(list(enumerate(requests)))
    return [row[: request.num_tokens] for row, request in zip(rows.tokens()[1].tolist(), requests,
                                                                strict=True)]  # fmt: skip


def step(held: HeldTokens, requests: list[Request], tokens: list[int]) -> None:
    """One sampling step: index, append the sampled tokens, and the scheduler's update."""
    rows = held.index(list(enumerate(requests)))
    held.append(rows, torch.tensor(tokens))
    for request, token in zip(requests, tokens, strict=True):
        request.output_token_ids.append(token)


def test_tokens_are_written_once_then_appended_on_the_device(monkeypatch):
    held = HeldTokens(torch.device("cpu"))
    writes = []
    real_write = HeldTokens._write
    monkeypatch.setattr(HeldTokens, "_write", lambda self, slot, ids: writes.append(ids)
                        or real_write(self, slot, ids))  # fmt: skip
    a, b = sampling_request("a", [5, 6, 7]), sampling_request("b", [9])
    for tokens in ([1, 2], [3, 4], [5, 5]):
        step(held, [a, b], tokens)
    assert held_ids(held, [a, b]) == [[5, 6, 7, 1, 3, 5], [9, 2, 4, 5]]
    assert writes == [[5, 6, 7], [9]]
    rows = held.index([(0, a), (1, b)])
    padding = rows.tokens()[1][1, b.num_tokens :]
    assert padding.numel() and (padding == 9).all()  # b's first token, which it holds


def test_a_token_in_flight_counts_and_a_stale_slot_is_written_again():
    """With a step in flight (two tokens pending) the table already holds that step's
    token, which the host does not have yet; a slot that disagrees with the host's count
    is written again from the host's ids."""
    held = HeldTokens(torch.device("cpu"))
    a = sampling_request("a", [3, 4])
    step(held, [a], [8])
    rows = held.index([(0, a)])
    held.append(rows, torch.tensor([6]))  # sampled; the scheduler has not seen it yet
    a.num_pending_tokens = 2
    assert held.index([(0, a)]).tokens()[1][0].tolist()[:4] == [3, 4, 8, 6]
    a.num_pending_tokens = 1
    a.output_token_ids.append(6)
    held._counts[held._slot_of["a"]] = 1  # as if an append had gone missing
    assert held_ids(held, [a]) == [[3, 4, 8, 6]]


def test_finished_requests_free_their_slots_and_the_table_grows():
    held = HeldTokens(torch.device("cpu"))
    long_prompt = list(range(1, MIN_WIDTH + 40))
    requests = [sampling_request(f"r{i}", [100 + i] * (i + 1)) for i in range(MIN_SLOTS + 3)]
    requests.append(sampling_request("long", long_prompt))
    step(held, requests, list(range(len(requests))))
    expected = [r.prompt_token_ids + r.output_token_ids for r in requests]
    assert held_ids(held, requests) == expected
    assert held.num_slots_in_use == len(requests)
    for request in requests[:5]:
        request.status = RequestStatus.FINISHED_STOPPED
    newcomer = sampling_request("new", [42, 43])
    assert held_ids(held, requests[5:] + [newcomer]) == expected[5:] + [[42, 43]]
    assert held.num_slots_in_use == len(requests) - 5 + 1


def test_another_request_under_the_same_id_gets_its_own_tokens():
    held = HeldTokens(torch.device("cpu"))
    first = sampling_request("same", [1, 2, 3])
    step(held, [first], [4])
    second = sampling_request("same", [7])
    assert held_ids(held, [second]) == [[7]]


def test_a_slot_written_while_a_token_is_in_flight_takes_that_token_too(monkeypatch):
    """Written again from the host while a token is in flight, a slot also takes that
    token (from the device), so it does not stay a token behind and get written again at
    every step after."""
    from engine.penalties import InFlightOutputs

    held = HeldTokens(torch.device("cpu"))
    writes = []
    real_write = HeldTokens._write
    monkeypatch.setattr(HeldTokens, "_write", lambda self, slot, ids: writes.append(ids)
                        or real_write(self, slot, ids))  # fmt: skip
    a = sampling_request("a", [3, 4])
    step(held, [a], [8])
    held._counts[held._slot_of["a"]] = 1  # stale, as if an append had gone missing
    a.num_pending_tokens = 2  # the previous step's token (6) is still in flight
    in_flight = InFlightOutputs(torch.tensor([0]), torch.tensor([6]), rows_host=(0,))
    rows = held.index([(0, a)], in_flight)
    assert rows.tokens()[1][0].tolist()[:4] == [3, 4, 8, 6] and len(writes) == 2
    held.append(rows, torch.tensor([1]))
    a.output_token_ids.append(6)  # the scheduler's update of the step before
    assert held_ids(held, [a]) == [[3, 4, 8, 6]]
    a.output_token_ids.append(1)  # the step that sampled 1 has been read meanwhile
    a.num_pending_tokens = 1
    step(held, [a], [2])
    assert held_ids(held, [a]) == [[3, 4, 8, 6, 1, 2]]
    assert len(writes) == 2  # none since
