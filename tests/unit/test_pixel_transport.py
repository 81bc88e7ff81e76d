"""Pixels travel to the engine as uint8 levels and are normalised on its device.

The server sends `ProcessedImage.pixel_levels` (uint8) with a `PixelNormalization`; the
engine looks the levels up in a per-channel table. That must give exactly the float32
values transformers' arithmetic gives (tests/unit/test_image_processor.py checks every
level), so a request sent as levels and the same request sent as normalised float32
values must generate the same tokens with the same logprobs, and anything else that
claims to be pixels is refused with a clear error, alone.
"""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
import torch
from PIL import Image

from engine import LLM, SamplingParams
from engine.errors import MediaError
from engine.multimodal.image_processor import (
    ImageProcessorConfig,
    normalize_pixels,
    process_image,
)
from engine.protocol import FinishReason, PixelNormalization
from engine.serialization import tensor_ref
from engine.tiny_model import make_tiny_model

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=1)


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    return LLM(str(make_tiny_model(tmp_path_factory.mktemp("pixels"))), num_kv_blocks=128)


def picture(seed: int) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (84, 112, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def image_request(llm: LLM, request_id: str, seed: int = 0):
    """An EngineRequest (uint8 levels, as the server sends it) and its tensors."""
    content = [{"type": "image", "image": picture(seed)}, {"type": "text", "text": "What?"}]
    messages = [{"role": "user", "content": content}]
    built = llm._chat_request(request_id, messages, GREEDY, llm.processing)
    return built.request, built.tensors


def with_pixels(request, pixels: torch.Tensor, normalization: PixelNormalization | None):
    """`request` with other pixels for its image, under another content hash (so that
    neither the encoder cache nor the prefix cache reuses the original's work)."""
    media = msgspec.structs.replace(
        request.media[0],
        content_hash="other:" + request.media[0].content_hash,
        pixel_values=tensor_ref(0, pixels),
        normalization=normalization,
    )
    return msgspec.structs.replace(request, media=[media]), [pixels]


def run(llm: LLM, *requests) -> dict:
    """request id -> (token ids, logprobs, finish reason, error) of requests run together."""
    results: dict = {}
    for request, tensors in requests:
        llm.engine.add_request(request, tensors)
        results[request.request_id] = ([], [], None, None)
    while llm.engine.has_unfinished_requests():
        for output in llm.engine.step().outputs:
            tokens, logprobs, _, _ = results[output.request_id]
            tokens += output.new_token_ids
            logprobs += [lp.logprob for lp in output.logprobs or []]
            results[output.request_id] = (tokens, logprobs, output.finish_reason, output.error)
    return results


def test_levels_and_normalised_floats_generate_the_same(llm):
    request, tensors = image_request(llm, "levels")
    assert tensors[0].dtype == torch.uint8 and request.media[0].normalization is not None
    values = normalize_pixels(tensors[0], request.media[0].normalization)
    as_floats = with_pixels(msgspec.structs.replace(request, request_id="floats"), values, None)
    levels_result = run(llm, (request, tensors))["levels"]
    floats_result = run(llm, as_floats)["floats"]
    assert levels_result[2] == FinishReason.LENGTH and levels_result[3] is None
    assert floats_result[:2] == levels_result[:2]  # same tokens, bit-identical logprobs


BAD_PIXELS = [
    ("uint8 without normalization", torch.uint8, None, "need a normalization"),
    ("two channels", torch.uint8, PixelNormalization(1 / 255, (0.5, 0.5), (0.5, 0.5)), "3 means"),
    ("zero std", torch.uint8, PixelNormalization(1 / 255, (0.5,) * 3, (0.5, 0.0, 0.5)), "finite"),
    ("int64 levels", torch.int64, None, "uint8 levels or floating point"),
    ("float with normalization", torch.float32, ImageProcessorConfig().normalization, "only"),
]


@pytest.mark.parametrize("dtype, normalization, message", [b[1:] for b in BAD_PIXELS],
                         ids=[b[0] for b in BAD_PIXELS])  # fmt: skip
def test_bad_pixel_encodings_fail_alone(llm, dtype, normalization, message):
    good = image_request(llm, "good", seed=1)
    bad_request, tensors = image_request(llm, "bad", seed=2)
    bad = with_pixels(bad_request, tensors[0].to(dtype), normalization)
    results = run(llm, bad, good)
    tokens, _, finish, error = results["bad"]
    assert finish == FinishReason.ERROR and tokens == []
    assert error.code == "invalid_media" and message in error.message
    assert error.param == "media[0]"
    assert results["good"][2] == FinishReason.LENGTH and len(results["good"][0]) == 8


def test_normalize_pixels_checks_its_input():
    normalization = ImageProcessorConfig().normalization
    with pytest.raises(MediaError, match="2-D uint8"):
        normalize_pixels(torch.zeros(4, 12), normalization)
    with pytest.raises(MediaError, match="does not fit"):
        normalize_pixels(torch.zeros(4, 10, dtype=torch.uint8), normalization)


def test_processed_image_sends_a_quarter_of_float32_bytes():
    processed = process_image(picture(3), ImageProcessorConfig())
    assert processed.pixel_levels.dtype == torch.uint8
    assert processed.pixel_values.dtype == torch.float32
    assert processed.pixel_values.nbytes == 4 * processed.pixel_levels.nbytes


def test_media_spans_that_miss_their_placeholders_fail_alone(llm):
    """The engine checks that a media span covers placeholders only, and that the prompt
    holds no placeholder outside the spans (a request made by something other than this
    server's API may be malformed); such a request fails with its own error."""
    request, tensors = image_request(llm, "shifted", seed=4)
    media = request.media[0]
    shifted = msgspec.structs.replace(request, media=[
        msgspec.structs.replace(media, offset=media.offset - 1)])  # fmt: skip
    extra_request, extra_tensors = image_request(llm, "extra", seed=5)
    image_id = llm.engine.model_config.image_token_id
    extra = msgspec.structs.replace(
        extra_request, prompt_token_ids=[*extra_request.prompt_token_ids, image_id]
    )
    results = run(llm, (shifted, tensors), (extra, extra_tensors), image_request(llm, "good"))
    for request_id, message in (("shifted", "is not made of placeholder tokens"),
                                ("extra", "media placeholder tokens but")):  # fmt: skip
        tokens, _, finish, error = results[request_id]
        assert finish == FinishReason.ERROR and tokens == [] and message in error.message
    assert results["good"][2] == FinishReason.LENGTH
