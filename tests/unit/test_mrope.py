"""M-RoPE positions for text, image and video spans (hand-computed expectations;
tests/parity/test_model_forward.py checks them against transformers' get_rope_index)."""

from __future__ import annotations

import pytest
import torch

from engine.errors import MediaError
from engine.models.mrope import decode_positions, mrope_positions


def test_text_only_is_arange_with_zero_delta():
    positions, delta = mrope_positions(list(range(7)), [], spatial_merge_size=2)
    assert delta == 0
    assert positions.dtype == torch.int64
    assert torch.equal(positions, torch.arange(7).expand(3, -1))


def test_image_grid_positions_and_delta():
    # 2 text tokens, an image of grid (1, 4, 6) -> 2 x 3 = 6 tokens, then 2 text tokens
    ids = [0, 0] + [9] * 6 + [0, 0]
    positions, delta = mrope_positions(ids, [(2, 6, (1, 4, 6), "image")], spatial_merge_size=2)
    expected = torch.tensor(
        [
            [0, 1, 2, 2, 2, 2, 2, 2, 5, 6],
            [0, 1, 2, 2, 2, 3, 3, 3, 5, 6],
            [0, 1, 2, 3, 4, 2, 3, 4, 5, 6],
        ]
    )
    assert torch.equal(positions, expected)
    assert delta == 7 - 10
    assert torch.equal(decode_positions(10, 2, delta), torch.tensor([[7, 8]] * 3))


def test_video_frames_advance_temporal_row():
    ids = [0] + [9] * 8
    positions, delta = mrope_positions(ids, [(1, 8, (2, 4, 4), "video")], spatial_merge_size=2)
    assert positions[0].tolist() == [0, 1, 1, 1, 1, 2, 2, 2, 2]
    assert positions[1].tolist() == [0, 1, 1, 2, 2, 1, 1, 2, 2]
    assert positions[2].tolist() == [0, 1, 2, 1, 2, 1, 2, 1, 2]
    assert delta == 3 - 9


def test_qwen2_5_spaces_video_frames_by_time_and_not_images():
    # 3 temporal patches of 7/6 s at 2 tokens per second: floor(i x 2.33) = 0, 2, 4; the
    # image after it and the text keep Qwen2-VL's rules.
    ids = [0] + [9] * 3 + [8] * 4 + [1]
    media = [(1, 3, (3, 2, 2), "video"), (4, 4, (1, 4, 4), "image")]
    positions, delta = mrope_positions(
        ids, media, spatial_merge_size=2, tokens_per_second=2, second_per_grid_ts=[7 / 6, 5.0]
    )
    assert positions[0].tolist() == [0, 1, 3, 5, 2, 2, 2, 2, 4]
    assert positions[1].tolist() == [0, 1, 1, 1, 2, 2, 3, 3, 4]
    # Decoding steps on from the last token (4), not from the video's position 5.
    assert delta == 5 - 9
    assert decode_positions(9, 1, delta)[:, 0].tolist() == [5, 5, 5]
    plain, _ = mrope_positions(ids, media, spatial_merge_size=2)  # Qwen2-VL: steps of 1
    assert plain[0].tolist()[:4] == [0, 1, 2, 3]


def test_two_adjacent_media_and_trailing_media():
    ids = [9] * 4 + [8] * 4
    media = [(0, 4, (1, 4, 4), "image"), (4, 4, (1, 4, 4), "image")]
    positions, delta = mrope_positions(ids, media, spatial_merge_size=2)
    assert positions[1].tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    assert delta == 4 - 8


@pytest.mark.parametrize(
    "media",
    [
        [(2, 5, (1, 4, 6), "image")],  # wrong token count
        [(6, 6, (1, 4, 6), "image")],  # past the end
        [(2, 6, (1, 4, 6), "image"), (1, 1, (1, 2, 2), "image")],  # out of order
        [(2, 3, (1, 3, 4), "image")],  # grid not a multiple of the merge size
    ],
)
def test_bad_spans_raise_media_error(media):
    with pytest.raises(MediaError):
        mrope_positions([0] * 10, media, spatial_merge_size=2)
