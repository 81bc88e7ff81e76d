"""Feature files are checked (header first, then values) before any of them is used."""

from __future__ import annotations

import json
import pickle
import struct

import pytest
import torch
from safetensors.torch import save

from engine.feature_validation import FeatureError, FeatureSpec, validate_features

SPEC = FeatureSpec(hidden_size=8, num_tokens=4, grid_thw=(1, 4, 4))


def feature_file(embeds: torch.Tensor, grid=(1, 4, 4)) -> bytes:
    tensors = {"embeds": embeds}
    if grid is not None:
        tensors["grid_thw"] = torch.tensor(grid, dtype=torch.int64)
    return save(tensors)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_valid_file_loads(dtype):
    embeds = torch.randn(4, 8).to(dtype)
    result = validate_features(feature_file(embeds), SPEC)
    assert result.dtype == dtype and torch.equal(result, embeds)
    assert validate_features(feature_file(embeds, grid=None), SPEC).shape == (4, 8)


@pytest.mark.parametrize(
    ("data", "reason", "words"),
    [
        (feature_file(torch.randn(4, 16)), "wrong_shape", "hidden size 8"),
        (feature_file(torch.randn(5, 8)), "wrong_shape", "implies 4 tokens"),
        (feature_file(torch.randn(4, 8), grid=(1, 2, 8)), "wrong_shape", "grid_thw"),
        (feature_file(torch.randn(4, 8).double()), "bad_dtype", "F64"),
        (feature_file(torch.ones(4, 8, dtype=torch.int32)), "bad_dtype", "I32"),
        (pickle.dumps({"embeds": [[0.0] * 8] * 4}), "bad_format", "safetensors"),
        (save({"other": torch.zeros(4, 8)}), "bad_format", "other"),
        (b"", "bad_format", "too short"),
        (struct.pack("<Q", 60_000) + b"[" * 60_000, "bad_format", "bad header"),  # deep JSON
        # cut in its data: it said "malformed header entry", which sent its writer to the
        # header (fuzz61)
        (feature_file(torch.randn(4, 8))[:-20], "bad_format", "shorter than its header says"),
    ],
)
def test_bad_files_are_refused(data, reason, words):
    with pytest.raises(FeatureError) as info:
        validate_features(data, SPEC)
    assert info.value.reason == reason
    assert words in info.value.message
    assert info.value.status == 400


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_values_are_refused(value):
    embeds = torch.randn(4, 8)
    embeds[2, 3] = value
    with pytest.raises(FeatureError) as info:
        validate_features(feature_file(embeds), SPEC)
    assert info.value.reason == "non_finite"


def test_declared_sizes_are_checked_before_allocating():
    # A header that claims a huge tensor in a tiny file is refused from the header alone.
    header = {"embeds": {"dtype": "F32", "shape": [4, 8], "data_offsets": [0, 1 << 40]}}
    encoded = json.dumps(header).encode()
    data = struct.pack("<Q", len(encoded)) + encoded + b"\0" * 128
    with pytest.raises(FeatureError) as info:
        validate_features(data, SPEC)
    assert info.value.reason == "bad_format"
    huge_header = struct.pack("<Q", 1 << 50) + b"{}"
    with pytest.raises(FeatureError, match="header length"):
        validate_features(huge_header, SPEC)


def test_shape_and_offsets_must_agree():
    header = {"embeds": {"dtype": "F32", "shape": [4, 8], "data_offsets": [0, 64]}}
    encoded = json.dumps(header).encode()
    data = struct.pack("<Q", len(encoded)) + encoded + b"\0" * 64
    with pytest.raises(FeatureError, match="declares a size"):
        validate_features(data, SPEC)
