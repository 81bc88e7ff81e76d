"""Messages and tensors <-> ZMQ frames, for both sides of the engine socket.

A message on the wire is a list of frames:

    frame 0      msgpack of one engine.protocol message (never pickle)
    frame 1..N   raw, C-contiguous tensor buffers; tensor i travels in frame i + 1 and is
                 described inside the message by a `TensorRef(frame=i, dtype, shape)`

Sending is zero-copy (frames are memoryviews of the tensors' storage; keep the tensors
alive until the send completed, which `zmq` does by holding the buffer). Receiving copies
each buffer once into memory that the returned tensor owns, so the engine may keep or
modify it freely. Anything that does not decode cleanly into the expected message type,
or whose frames do not match their TensorRefs, raises `MessageDecodeError`: the receiver
logs it and drops the message.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import msgspec
import numpy as np
import torch

from engine.errors import TesseraError
from engine.protocol import (
    ENCODER,
    ENGINE_INBOX_DECODER,
    SERVER_INBOX_DECODER,
    EngineRequest,
    TensorRef,
)

Frame = bytes | bytearray | memoryview

# Every dtype allowed on the wire. bfloat16 has no numpy twin: it is sent as its int16 bits.
_TORCH_DTYPES: dict[str, torch.dtype] = {
    "float64": torch.float64,
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
_MAX_NDIM = 8


class MessageDecodeError(TesseraError):
    """A received message is not a valid protocol message (garbage, wrong type, a pickle,
    or tensor frames that do not match their TensorRefs). The receiver drops it."""

    code = "message_decode_error"


def dtype_name(tensor: torch.Tensor | np.ndarray) -> str:
    """The wire name of a tensor's dtype, e.g. "float32", "bfloat16"."""
    if isinstance(tensor, torch.Tensor):
        name = str(tensor.dtype).removeprefix("torch.")
    else:
        name = "bool" if tensor.dtype == np.bool_ else tensor.dtype.name
    if name not in _TORCH_DTYPES:
        raise TypeError(f"dtype {name} cannot be sent to the engine")
    return name


def tensor_ref(frame: int, tensor: torch.Tensor | np.ndarray) -> TensorRef:
    """The TensorRef describing `tensor` sent as extra frame number `frame` (0-based)."""
    return TensorRef(frame=frame, dtype=dtype_name(tensor), shape=tuple(tensor.shape))


def tensor_to_buffer(tensor: torch.Tensor | np.ndarray) -> memoryview:
    """A flat byte view of `tensor` in C order (a copy only if it is not contiguous or
    not on the CPU)."""
    if isinstance(tensor, torch.Tensor):
        tensor = tensor.detach()
        if tensor.device.type != "cpu":
            tensor = tensor.cpu()
        tensor = tensor.contiguous()
        if tensor.dtype == torch.bfloat16:
            tensor = tensor.view(torch.int16)  # numpy has no bfloat16; the bits are the same
        array = tensor.numpy()
    else:
        dtype_name(tensor)  # reject object / string arrays early
        array = np.ascontiguousarray(tensor)
    return memoryview(array.reshape(-1).view(np.uint8))


def encode_message(
    message: msgspec.Struct, tensors: Sequence[torch.Tensor | np.ndarray] = ()
) -> list[Frame]:
    """Frames for `message` plus one raw frame per tensor (tensor i -> frame i + 1)."""
    frames: list[Frame] = [ENCODER.encode(message)]
    frames.extend(tensor_to_buffer(tensor) for tensor in tensors)
    return frames


def buffer_to_tensor(buffer: Frame, ref: TensorRef) -> torch.Tensor:
    """Rebuild the tensor described by `ref` from its frame, checking size and dtype."""
    dtype = _TORCH_DTYPES.get(ref.dtype)
    if dtype is None:
        raise MessageDecodeError(f"unsupported tensor dtype {ref.dtype!r}")
    if len(ref.shape) > _MAX_NDIM or any(dim < 0 for dim in ref.shape):
        raise MessageDecodeError(f"invalid tensor shape {ref.shape}")
    view = memoryview(buffer).cast("B")
    itemsize = torch.empty((), dtype=dtype).element_size()
    expected = math.prod(ref.shape) * itemsize
    if view.nbytes != expected:
        raise MessageDecodeError(
            f"tensor frame {ref.frame} has {view.nbytes} bytes, expected {expected}"
        )
    if expected == 0:
        return torch.empty(ref.shape, dtype=dtype)
    # One copy into memory the tensor owns: the frame's memory belongs to zmq.
    flat = torch.frombuffer(bytearray(view), dtype=dtype)
    return flat.reshape(ref.shape)


def tensor_refs(message: Any) -> list[TensorRef]:
    """Every TensorRef a message carries (only EngineRequest carries tensors today)."""
    if isinstance(message, EngineRequest):
        return [item.pixel_values for item in message.media if item.pixel_values is not None]
    return []


def _decode(frames: Sequence[Frame], decoder: msgspec.msgpack.Decoder) -> tuple[Any, list]:
    if not frames:
        raise MessageDecodeError("empty message")
    try:
        message = decoder.decode(frames[0])
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise MessageDecodeError(f"undecodable message: {exc}") from None
    num_tensors = len(frames) - 1
    by_frame: dict[int, TensorRef] = {}
    for ref in tensor_refs(message):
        if not 0 <= ref.frame < num_tensors:
            raise MessageDecodeError(f"tensor frame {ref.frame} is missing")
        if by_frame.setdefault(ref.frame, ref) != ref:
            raise MessageDecodeError(f"tensor frame {ref.frame} is described twice differently")
    if len(by_frame) != num_tensors:
        raise MessageDecodeError(f"{num_tensors - len(by_frame)} tensor frame(s) not referenced")
    tensors = [buffer_to_tensor(frames[i + 1], by_frame[i]) for i in range(num_tensors)]
    return message, tensors


def decode_engine_inbox(frames: Sequence[Frame]) -> tuple[Any, list[torch.Tensor]]:
    """Decode server -> engine frames into (a `ServerToEngine` message, tensors),
    `tensors[i]` being the tensor of frame i + 1. Raises MessageDecodeError."""
    return _decode(frames, ENGINE_INBOX_DECODER)


def decode_server_inbox(frames: Sequence[Frame]) -> Any:
    """Decode engine -> server frames into an `EngineToServer` message.
    Raises MessageDecodeError."""
    message, _ = _decode(frames, SERVER_INBOX_DECODER)
    return message
