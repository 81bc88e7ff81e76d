"""A Qwen3-VL video given as pre-encoded features: placed temporal patch by temporal patch
(each its own item, a row range of the one file), fetched once, and checked in the engine."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from engine.config import EngineConfig
from engine.errors import MediaError
from engine.feature_admission import FeatureAdmission, FeatureUse
from engine.feature_validation import FeatureSpec
from engine.multimodal.placement import place_media
from engine.multimodal.prompt import PlaceholderSpan
from engine.protocol import FeatureSource, MediaInput, Modality
from engine.request_checks import _cache_key, _check_feature_rows

URL = "s3://features/clip.safetensors"
PER_PATCH = 4  # grid (1, 4, 4) / merge 2**2


def video_features(url: str = URL) -> MediaInput:
    return MediaInput(modality=Modality.VIDEO, content_hash="feature-url:abc", offset=0,
                      num_tokens=3 * PER_PATCH, grid_thw=(3, 4, 4),
                      feature=FeatureSource(url))  # fmt: skip


def patch_spans(item: int, first_offset: int) -> list[PlaceholderSpan]:
    # each patch after its "<t seconds><|vision_start|>" tokens
    return [PlaceholderSpan("video", first_offset + frame * 10, PER_PATCH, item, frame)
            for frame in range(3)]  # fmt: skip


def test_each_temporal_patch_is_a_row_range_of_the_file():
    placed, tensors = place_media([video_features()], patch_spans(0, 5), [])
    assert tensors == []
    assert [item.offset for item in placed] == [5, 15, 25]
    assert [item.grid_thw for item in placed] == [(1, 4, 4)] * 3
    assert [item.frame for item in placed] == [0, 1, 2]
    keys = [_cache_key(item, None) for item in placed]  # each patch its own encoder entry
    assert keys == [f"feature-url:abc/t{t}" for t in range(3)]
    assert [item.feature for item in placed] == [
        FeatureSource(URL, rows=(t * PER_PATCH, (t + 1) * PER_PATCH), file_grid_thw=(3, 4, 4))
        for t in range(3)
    ]
    for item in placed:
        _check_feature_rows(item, "messages[0]")  # what the engine accepts


def test_the_patches_of_one_file_are_one_download():
    other = "s3://features/other.safetensors"
    placed, _ = place_media([video_features(), video_features(other)],
                            patch_spans(0, 5) + patch_spans(1, 40), [])  # fmt: skip
    submitted = []
    runner = SimpleNamespace(model_config=SimpleNamespace(encoder_width=64))
    admission = FeatureAdmission(EngineConfig(model="unused"), runner, scheduler=None)
    admission._fetcher = SimpleNamespace(submit=lambda rid, jobs: submitted.append(jobs))
    assert admission.submit(SimpleNamespace(request_id="r"), placed)
    [jobs] = submitted
    assert [(job.url, job.spec) for job in jobs] == [
        (URL, FeatureSpec(64, 3 * PER_PATCH, (3, 4, 4))),
        (other, FeatureSpec(64, 3 * PER_PATCH, (3, 4, 4))),
    ]
    _, uses, _ = admission._fetching["r"]
    assert uses[1] == [FeatureUse(3 + t, (1, 4, 4), (t * PER_PATCH, (t + 1) * PER_PATCH))
                       for t in range(3)]  # fmt: skip
    assert uses[1][2].key("f00d", None) == "f00d@1x4x4/rows8-12"
    assert uses[1][2].key("f00d", "t1") == "salt2:t1|f00d@1x4x4/rows8-12"


@pytest.mark.parametrize(
    "rows, file_grid",
    [((1, 5), (3, 4, 4)), ((8, 16), (3, 4, 4)), ((0, 4), (3, 4, 8)), ((0, 4), None)],
)
def test_the_engine_refuses_rows_that_are_not_one_patch(rows, file_grid):
    item = MediaInput(modality=Modality.VIDEO, content_hash="x", offset=0, num_tokens=PER_PATCH,
                      grid_thw=(1, 4, 4), feature=FeatureSource(URL, rows, file_grid))  # fmt: skip
    with pytest.raises(MediaError):
        _check_feature_rows(item, "messages[0]")
