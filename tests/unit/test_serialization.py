"""Round trips of messages + tensor frames, and rejection of anything that is not one."""

from __future__ import annotations

import pickle

import msgspec
import numpy as np
import pytest
import torch

from engine.protocol import (
    ENCODER,
    AbortRequests,
    EngineFailed,
    EngineOutputs,
    EngineRequest,
    EngineStats,
    FinishReason,
    MediaInput,
    MediaUuid,
    Modality,
    RequestOutput,
    SamplingParams,
    Shutdown,
)
from engine.serialization import (
    MessageDecodeError,
    decode_engine_inbox,
    decode_server_inbox,
    encode_message,
    tensor_ref,
)


def _request(tensors) -> EngineRequest:
    media = [
        MediaInput(
            modality=Modality.IMAGE,
            content_hash=f"h{i}",
            offset=i,
            num_tokens=1,
            grid_thw=(1, 2, 2),
            pixel_values=tensor_ref(i, tensor),
        )
        for i, tensor in enumerate(tensors)
    ]
    return EngineRequest(
        request_id="r1", prompt_token_ids=[1, 2, 3], sampling=SamplingParams(), media=media
    )


def _round_trip(tensors):
    frames = encode_message(_request(tensors), tensors)
    # What zmq hands the receiver: plain bytes per frame.
    message, decoded = decode_engine_inbox([bytes(frame) for frame in frames])
    assert isinstance(message, EngineRequest)
    assert len(decoded) == len(tensors)
    return message, decoded


@pytest.mark.parametrize(
    "tensor",
    [
        torch.randn(5, 7),
        torch.randn(3, 4).to(torch.bfloat16),
        torch.arange(-6, 6, dtype=torch.int64).reshape(3, 4),
        torch.tensor(3.5),  # 0-d
        torch.empty(0, 1176),  # empty
        torch.randn(6, 4).t(),  # non-contiguous
        torch.randn(4, 6, dtype=torch.float16)[:, ::2],  # strided
        torch.tensor([True, False, True]),
    ],
    ids=["float32", "bfloat16", "int64", "0d", "empty", "transposed", "strided", "bool"],
)
def test_tensor_round_trip(tensor: torch.Tensor) -> None:
    message, (decoded,) = _round_trip([tensor])
    assert message.media[0].pixel_values.dtype == str(tensor.dtype).removeprefix("torch.")
    assert decoded.dtype == tensor.dtype
    assert decoded.shape == tensor.shape
    assert torch.equal(decoded, tensor)
    if tensor.dtype != torch.bool:
        decoded.add_(1)  # the decoded tensor owns writable memory


def test_several_tensors_and_numpy() -> None:
    tensors = [torch.randn(2, 3), np.arange(12, dtype=np.int32).reshape(3, 4)]
    message, decoded = _round_trip(tensors)
    assert [ref.pixel_values.frame for ref in message.media] == [0, 1]
    assert torch.equal(decoded[0], tensors[0])
    assert torch.equal(decoded[1], torch.from_numpy(tensors[1]))


def test_messages_without_tensors() -> None:
    for message in (AbortRequests(["a", "b"]), Shutdown()):
        decoded, tensors = decode_engine_inbox(encode_message(message))
        assert decoded == message and tensors == []
    outputs = EngineOutputs(
        outputs=[RequestOutput(request_id="a", new_token_ids=[4], finish_reason=FinishReason.STOP)],
        stats=EngineStats(num_running=1, kv_cache_usage=0.5),
    )
    assert decode_server_inbox(encode_message(outputs)) == outputs
    assert decode_server_inbox(encode_message(EngineFailed("boom"))) == EngineFailed("boom")
    # Relayed between API processes through the engine: both directions decode it.
    uuid = MediaUuid(uuid="tile-1", modality=Modality.VIDEO, grid_thw=(2, 4, 6), num_tokens=12,
                     second_per_grid_t=0.5, frame_seconds=(0.0, 1.0))  # fmt: skip
    assert decode_engine_inbox(encode_message(uuid)) == (uuid, [])
    assert decode_server_inbox(encode_message(uuid)) == uuid


@pytest.mark.parametrize(
    "frames",
    [
        [],
        [b""],
        [b"\x00\x01garbage\xff"],
        [pickle.dumps(Shutdown())],
        [pickle.dumps({"type": "Shutdown"})],
        [ENCODER.encode({"type": "NotAMessage"})],
        [ENCODER.encode(EngineFailed("wrong direction"))],
    ],
    ids=["empty", "blank", "garbage", "pickle-struct", "pickle-dict", "unknown-tag", "wrong-dir"],
)
def test_garbage_is_rejected(frames) -> None:
    with pytest.raises(MessageDecodeError):
        decode_engine_inbox(frames)


def test_pickle_is_never_loaded(monkeypatch: pytest.MonkeyPatch) -> None:
    def explode(*args, **kwargs):
        raise AssertionError("pickle.loads called")

    monkeypatch.setattr(pickle, "loads", explode)
    with pytest.raises(MessageDecodeError):
        decode_engine_inbox([pickle.dumps(AbortRequests(["x"]))])


def test_tensor_frames_must_match_their_refs() -> None:
    tensor = torch.randn(4, 4)
    frames = encode_message(_request([tensor]), [tensor])
    with pytest.raises(MessageDecodeError, match="bytes"):
        decode_engine_inbox([frames[0], bytes(frames[1])[:-4]])  # truncated buffer
    with pytest.raises(MessageDecodeError, match="missing"):
        decode_engine_inbox(frames[:1])  # frame not sent
    with pytest.raises(MessageDecodeError, match="not referenced"):
        decode_engine_inbox([*frames, b"extra"])
    bad = msgspec.structs.replace(
        _request([tensor]).media[0],
        pixel_values=msgspec.structs.replace(tensor_ref(0, tensor), dtype="object"),
    )
    request = msgspec.structs.replace(_request([tensor]), media=[bad])
    with pytest.raises(MessageDecodeError, match="dtype"):
        decode_engine_inbox([ENCODER.encode(request), frames[1]])
