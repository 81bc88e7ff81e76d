"""gather_step_inputs: the flat batch of a step, decode rows (the hot path) and the general
path side by side in one batch, checked row by row against values worked out by hand."""

from __future__ import annotations

import torch

from engine.encoder_cache import EncoderCache
from engine.protocol import SamplingParams
from engine.request import MediaItem, Request
from engine.scheduler_output import ScheduledChunk
from engine.step_inputs import gather_step_inputs

BLOCK = 4


def make_request(
    request_id: str,
    prompt: list[int],
    outputs: list[int],
    blocks: list[int],
    *,
    media: list[MediaItem] | None = None,
    rope_delta: int = 0,
) -> Request:
    request = Request(request_id, prompt, SamplingParams(max_tokens=8), media=media)
    request.output_token_ids = list(outputs)
    request.block_ids = list(blocks)
    # Prompt positions 100 * row + index, so each row and index is recognisable.
    index = torch.arange(len(prompt))
    request.positions = torch.stack([index, 100 + index, 200 + index])  # [3, num_prompt]
    request.rope_delta = rope_delta
    return request


def image(offset: int, num_tokens: int, content_hash: str) -> MediaItem:
    return MediaItem("image", content_hash, offset, num_tokens, (1, 2, 2 * num_tokens))


def test_decode_rows_and_general_chunks_in_one_batch():
    encoder_cache = EncoderCache()
    encoder_cache.put("img-d", torch.arange(2 * 3, dtype=torch.float32).reshape(3, 2))
    encoder_cache.put("img-e", torch.arange(4 * 2, dtype=torch.float32).reshape(4, 2) + 50)
    decode = make_request("a", [10, 11, 12, 13, 14], [50, 51], [7, 3], rope_delta=-2)
    in_flight = make_request("b", [20, 21, 22, 23, 24], [60], [5, 6])
    in_flight.num_pending_tokens = 1  # index 6 is being sampled by the step in flight
    prompt_end = make_request("c", [30, 31, 32, 33, 34], [], [8, 9])
    prefill = make_request("f", [30, 31, 32, 33, 34], [], [8, 9])
    # An image at [1, 4) of the prompt, decoding past it: the decode path, media_end 4.
    past_image = make_request(
        "d", [40, 1, 1, 1, 44], [70], [11, 12], media=[image(1, 3, "img-d")], rope_delta=5
    )
    # The prompt ends inside an image at [2, 6): a one-token chunk that needs an encoder row.
    inside_image = make_request(
        "e", [45, 46, 1, 1, 1, 1], [], [13, 14], media=[image(2, 4, "img-e")]
    )
    chunks = [
        ScheduledChunk(decode, 6, 1, samples=True),
        ScheduledChunk(in_flight, 6, 1, samples=True),
        ScheduledChunk(prompt_end, 4, 1, samples=True),
        ScheduledChunk(past_image, 5, 1, samples=True),
        ScheduledChunk(inside_image, 5, 1, samples=True),
        ScheduledChunk(prefill, 1, 3, samples=False),  # a prefill chunk, general path
    ]

    inputs = gather_step_inputs(chunks, BLOCK, encoder_cache)

    assert inputs.input_ids == [51, 0, 34, 70, 1, 31, 32, 33]
    assert inputs.pending_rows == [1] and inputs.pending_request_ids == ["b"]
    assert inputs.positions.tolist() == [
        [4, 6, 4, 10, 5, 1, 2, 3],
        [4, 6, 104, 10, 105, 101, 102, 103],
        [4, 6, 204, 10, 205, 201, 202, 203],
    ]
    # index i lives in block_ids[i // 4] at offset i % 4.
    assert inputs.slot_mapping == [3 * 4 + 2, 6 * 4 + 2, 9 * 4 + 0, 12 * 4 + 1, 14 * 4 + 1,
                                   8 * 4 + 1, 8 * 4 + 2, 8 * 4 + 3]  # fmt: skip
    assert inputs.multimodal_rows == [4]
    assert torch.equal(torch.cat(inputs.multimodal_embeds), torch.tensor([[56.0, 57.0]]))
    assert inputs.query_lens == [1, 1, 1, 1, 1, 3]
    assert inputs.seq_lens == [7, 7, 5, 6, 6, 4]
    assert not inputs.is_decode_only


def test_a_decode_only_batch_gives_contiguous_positions():
    requests = [
        make_request(f"r{i}", [1, 2, 3], [4] * i, [i, i + 10], rope_delta=i) for i in range(1, 4)
    ]
    chunks = [ScheduledChunk(r, r.num_tokens - 1, 1, samples=True) for r in requests]

    inputs = gather_step_inputs(chunks, BLOCK, EncoderCache())

    # index + rope_delta on all three rows: (3 + 1), (4 + 2), (5 + 3)
    assert inputs.positions.tolist() == [[4, 6, 8]] * 3
    assert inputs.positions.is_contiguous() and inputs.positions.dtype == torch.long
    assert inputs.is_decode_only


def test_media_end_bounds_the_media_lookups():
    request = make_request(
        "m", [1, 1, 1, 9, 1, 1], [], [0, 1], media=[image(0, 3, "x"), image(4, 2, "y")]
    )
    assert request.media_end == 6
    assert [m.content_hash for m in request.media_overlapping(2, 5)] == ["x", "y"]
    assert request.media_overlapping(6, 7) == []
    assert make_request("t", [1, 2], [], [0]).media_end == 0
