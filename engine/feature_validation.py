"""Checks a downloaded pre-encoded feature file before any of it is used.

The format is safetensors only (never pickle, never `torch.load`):

    [8 bytes: header length N, little-endian u64][N bytes: JSON header][raw tensor data]

with a tensor `embeds` of shape [num_tokens, hidden_size] (float32 / bfloat16 / float16)
and optionally `grid_thw` (3 integers). The header is parsed and every declared size is
checked against the buffer and the expected shape *before* anything is allocated; then
the tensors are loaded with `safetensors` from the bytes and checked for NaN / Inf.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass

import torch
from safetensors.torch import load as load_safetensors

from engine.errors import MediaError

EMBEDS_DTYPES = {"F32": 4, "BF16": 2, "F16": 2}
GRID_DTYPES = {"I64": 8, "I32": 4, "U8": 1, "I16": 2, "U16": 2, "U32": 4, "U64": 8}
MAX_HEADER_BYTES = 1 << 20


class FeatureError(MediaError):
    """A pre-encoded feature could not be fetched or is unusable. `reason` is a short
    machine-readable cause (not_found, access_denied, timeout, too_large, bad_format,
    wrong_shape, bad_dtype, non_finite, network, server_error, store_auth, store_region,
    saturated, cancelled) used as a metric label.

    A store that failed (5xx or no connection after the retries: 502; no answer in time:
    504), refused the server's own credentials or region (502), or a server whose connections to it
    stayed busy (503) is the server's side, not the request's: a 5xx, which clients and
    load balancers retry, where a 400 would tell them the request itself is wrong."""

    def __init__(self, message: str, *, reason: str, param: str | None = None):
        super().__init__(message, param=param, code=f"feature_{reason}")
        self.reason = reason
        if reason in _STORE_FAILURE_STATUS:
            self.status, self.type = _STORE_FAILURE_STATUS[reason], "server_error"


_STORE_FAILURE_STATUS = {
    "server_error": 502,
    "network": 502,
    "store_auth": 502,
    "store_region": 502,
    "saturated": 503,
    "timeout": 504,
}


@dataclass(frozen=True)
class FeatureSpec:
    """What a feature file must contain to fill one media span."""

    hidden_size: int
    num_tokens: int
    grid_thw: tuple[int, int, int]


def validate_features(data: bytes, spec: FeatureSpec) -> torch.Tensor:
    """Returns `embeds` [num_tokens, hidden_size] (its stored dtype) or raises FeatureError."""
    header = _read_header(data)
    entries = _check_header(header, len(data) - 8 - _header_length(data), spec)
    try:
        tensors = load_safetensors(bytes(data))
    except Exception as exc:  # noqa: BLE001 - the library raises several types
        raise FeatureError("not a valid safetensors file", reason="bad_format") from exc
    embeds = tensors["embeds"]  # [num_tokens, hidden]
    if "grid_thw" in entries:
        grid = tuple(int(v) for v in tensors["grid_thw"].reshape(-1).tolist())
        if grid != tuple(spec.grid_thw):
            raise FeatureError(
                f"the file's grid_thw {grid} differs from the request's {tuple(spec.grid_thw)}",
                reason="wrong_shape",
            )
    if not bool(torch.isfinite(embeds).all()):
        raise FeatureError("embeds contain NaN or Inf values", reason="non_finite")
    return embeds


def _header_length(data: bytes) -> int:
    if len(data) < 8:
        raise FeatureError("not a safetensors file (too short)", reason="bad_format")
    (length,) = struct.unpack("<Q", data[:8])
    return length


def _read_header(data: bytes) -> dict:
    length = _header_length(data)
    if length > MAX_HEADER_BYTES or 8 + length > len(data):
        raise FeatureError("not a safetensors file (bad header length)", reason="bad_format")
    try:
        header = json.loads(bytes(data[8 : 8 + length]).decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):  # RecursionError: deep nesting
        raise FeatureError("not a safetensors file (bad header)", reason="bad_format") from None
    if not isinstance(header, dict):
        raise FeatureError("not a safetensors file (bad header)", reason="bad_format")
    return header


def _check_header(header: dict, num_data_bytes: int, spec: FeatureSpec) -> dict[str, dict]:
    entries = {k: v for k, v in header.items() if k != "__metadata__"}
    unknown = sorted(set(entries) - {"embeds", "grid_thw"})
    if unknown:
        raise FeatureError(f"unexpected tensors {unknown} in the file", reason="bad_format")
    if "embeds" not in entries:
        raise FeatureError("the file has no 'embeds' tensor", reason="bad_format")
    for name, entry in entries.items():
        if not isinstance(entry, dict):
            raise FeatureError(f"tensor {name!r} is malformed", reason="bad_format")
        _check_entry(name, entry, num_data_bytes)
    embeds = entries["embeds"]
    if embeds["dtype"] not in EMBEDS_DTYPES:
        raise FeatureError(
            f"embeds dtype {embeds['dtype']} is not one of float32, bfloat16, float16",
            reason="bad_dtype",
        )
    shape = tuple(embeds["shape"])
    expected = (spec.num_tokens, spec.hidden_size)
    if len(shape) != 2 or shape[1] != spec.hidden_size:
        raise FeatureError(
            f"embeds of shape {list(shape)} do not match the model's hidden size "
            f"{spec.hidden_size}",
            reason="wrong_shape",
        )
    if shape != expected:
        raise FeatureError(
            f"embeds have {shape[0]} rows but grid_thw {tuple(spec.grid_thw)} implies "
            f"{spec.num_tokens} tokens",
            reason="wrong_shape",
        )
    grid = entries.get("grid_thw")
    if grid is not None and (grid["dtype"] not in GRID_DTYPES or math.prod(grid["shape"]) != 3):
        raise FeatureError("grid_thw must be 3 integers", reason="bad_format")
    return entries


def _check_entry(name: str, entry: dict, num_data_bytes: int) -> None:
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    is_ok = (
        isinstance(dtype, str)
        and isinstance(shape, list)
        and all(isinstance(d, int) and d >= 0 for d in shape)
        and isinstance(offsets, list)
        and len(offsets) == 2
        and all(isinstance(o, int) for o in offsets)
        and 0 <= offsets[0] <= offsets[1]
    )
    if not is_ok:
        raise FeatureError(f"tensor {name!r} has a malformed header entry", reason="bad_format")
    if offsets[1] > num_data_bytes:  # a cut download, most likely
        raise FeatureError(
            f"the file is shorter than its header says: tensor {name!r} ends at data byte "
            f"{offsets[1]}, the file holds {num_data_bytes}",
            reason="bad_format",
        )
    item_size = {**EMBEDS_DTYPES, **GRID_DTYPES}.get(dtype)
    if item_size is None:
        if name == "embeds":
            raise FeatureError(
                f"embeds dtype {dtype} is not one of float32, bfloat16, float16",
                reason="bad_dtype",
            )
        raise FeatureError(f"tensor {name!r} has unsupported dtype {dtype}", reason="bad_format")
    if math.prod(shape) * item_size != offsets[1] - offsets[0]:
        raise FeatureError(
            f"tensor {name!r} declares a size its data does not have", reason="bad_format"
        )
