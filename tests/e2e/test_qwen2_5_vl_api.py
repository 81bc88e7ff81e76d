"""A Qwen2.5-VL checkpoint served over HTTP answers as transformers'
Qwen2_5_VLForConditionalGeneration does, for every way a video's timing reaches the engine:
a `video_url` (seconds per temporal patch from the decoded file), a uuid-only part (from
what the server remembers of the uuid), and `video_features` (the part's
`second_per_grid_t` as `tessera encode-features` prints it, or the server's default). The clip is 20 s long and --max-video-frames
(32) keeps 32 of its 40 frames: 1.25 s per temporal patch puts its 16 temporal patches at
positions 0, 2, 5, 7, ..., 37 (1 s: 0, 2, ..., 30), so a wrong or missing value changes
the tokens."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json

import pytest

pytest.importorskip("transformers")
openai = pytest.importorskip("openai")

from tokenizers import Tokenizer  # noqa: E402

from bench.datasets import data_url  # noqa: E402
from bench.local_inputs import moving_pictures, picture, png_bytes, video_bytes  # noqa: E402
from engine.encode_features import main as encode_main  # noqa: E402
from engine.multimodal.video import VideoConfig  # noqa: E402
from engine.multimodal.video_decode import load_video  # noqa: E402
from engine.tiny_model import make_tiny_model  # noqa: E402
from tests.e2e.conftest import MODEL_NAME, run_server  # noqa: E402
from tests.hf_reference import HFGreedy  # noqa: E402

NUM_NEW = 12
GREEDY = {"temperature": 0, "max_tokens": NUM_NEW, "extra_body": {"ignore_eos": True}}
QUESTION = {"type": "text", "text": "What happens here?"}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("q25_http"), size="tiny-qwen2.5-vl", seed=8)


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("q25_http_log") / "server.log"
    with run_server(model_dir, log, "--enable-feature-inputs") as handle:
        yield handle


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)


def answer(client, content: list[dict]):
    response = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": content}], **GREEDY
    )
    return response.usage.prompt_tokens, response.choices[0].message.content


def logprobs(client, content: list[dict]) -> list[float]:
    """The chosen tokens' logprobs (runs may differ in the last bits: the feature path
    takes rows in another dtype round trip, so compare them with a tolerance)."""
    response = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": content}], logprobs=True, **GREEDY
    )
    return [item.logprob for item in response.choices[0].logprobs.content]


def encoded_video(model_dir, clip: bytes, folder) -> dict:
    """`tessera encode-features` of the clip: its JSON line, the file as a data: URL."""
    path = folder / "clip.mp4"
    path.write_bytes(clip)
    output = io.StringIO()
    with contextlib.redirect_stdout(output):
        assert encode_main(["--model", str(model_dir), "--output", str(folder), str(path)]) == 0
    line = json.loads(output.getvalue().strip().splitlines()[-1])
    return {**line, "url": data_url((folder / "clip.safetensors").read_bytes())}


def test_pictures_and_timed_videos_match_transformers(client, model_dir, tmp_path):
    reference = HFGreedy(model_dir)
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    image = picture(196, 140, 4)
    clip = video_bytes(moving_pictures(56, 56, 40, salt=3), fps=2)  # 32 frames at 1.6 fps
    video = load_video(clip, VideoConfig.from_model_dir(model_dir))
    assert (video.grid_thw[0], video.second_per_grid_t) == (16, pytest.approx(1.25))

    def expected(kinds: list[str], images=(), videos=()) -> tuple[int, str]:
        content = [{"type": kind} for kind in kinds] + [QUESTION]
        inputs = reference.inputs([{"role": "user", "content": content}], images, videos)
        tokens = reference.generate(inputs, NUM_NEW)
        return inputs["input_ids"].shape[1], tokenizer.decode(tokens)

    image_part = {
        "type": "image_url",
        "image_url": {"url": data_url(png_bytes(image), "image/png")},
    }
    video_part = {"type": "video_url", "video_url": {"url": data_url(clip, "video/mp4")}}
    assert answer(client, [image_part, QUESTION]) == expected(["image"], images=[image])
    want = expected(["video"], videos=[video])
    assert answer(client, [{**video_part, "uuid": "clip-7"}, QUESTION]) == want
    assert answer(client, [{"type": "video_url", "uuid": "clip-7"}, QUESTION]) == want
    encoded = encoded_video(model_dir, clip, tmp_path)
    assert encoded["second_per_grid_t"] == video.second_per_grid_t
    features = {"url": encoded["url"], "grid_thw": encoded["grid_thw"]}
    timed = {**features, "second_per_grid_t": encoded["second_per_grid_t"]}
    assert answer(client, [{"type": "video_features", "video_features": timed}, QUESTION]) == want
    # Without the field a feature part counts as sampled at --video-fps (2): 1 s per patch.
    # (This random model picks the same tokens either way; its logprobs tell them apart.)
    untimed_part = {"type": "video_features", "video_features": features}
    one_second = dataclasses.replace(video, second_per_grid_t=1.0)
    assert answer(client, [untimed_part, QUESTION]) == expected(["video"], videos=[one_second])
    timed_part = {"type": "video_features", "video_features": timed}
    untimed_logprobs = logprobs(client, [untimed_part, QUESTION])
    timed_logprobs = logprobs(client, [timed_part, QUESTION])
    # Equal but for rounding (rounding both to 4 decimals once split -3.69615 either way).
    assert logprobs(client, [video_part, QUESTION]) == pytest.approx(timed_logprobs, abs=1e-4)
    gap = max(abs(a - b) for a, b in zip(timed_logprobs, untimed_logprobs, strict=True))
    print(f"largest logprob gap between 1.25 s and 1 s per temporal patch: {gap:.5f}")
    assert gap > 1e-3


def test_a_bad_second_per_grid_t_is_a_400(server):
    import httpx

    features = {"url": "data:application/octet-stream;base64,AAAA", "grid_thw": [2, 4, 4]}
    for bad in (0, -1.5, "soon"):
        body = {
            "model": MODEL_NAME,
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "video_features",
                            "video_features": {**features, "second_per_grid_t": bad},
                        },
                        QUESTION,
                    ],
                }
            ],  # fmt: skip
        }
        response = httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=30)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert "second_per_grid_t" in (error["param"] or "") + error["message"]
