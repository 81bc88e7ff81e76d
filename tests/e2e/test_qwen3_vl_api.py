"""A Qwen3-VL checkpoint (`tiny-qwen3-vl`) served over HTTP answers as transformers'
Qwen3VLForConditionalGeneration does: a picture by data: URL, the same picture as
`image_features` written by `tessera encode-features` (whose rows carry the deepstack
levels beside the merged ones), and a video laid out frame by frame after each temporal
patch's time, sent whole, by its uuid alone, or as its video_features with those times."""

from __future__ import annotations

import contextlib
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
QUESTION = {"type": "text", "text": "What is in the picture?"}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("q3vl_http"), size="tiny-qwen3-vl", seed=8)


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("q3vl_http_log") / "server.log"
    with run_server(model_dir, log, "--enable-feature-inputs") as handle:
        yield handle


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)


def answer(client, content: list[dict]) -> tuple[int, str]:
    response = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": content}], **GREEDY
    )
    return response.usage.prompt_tokens, response.choices[0].message.content


def encode_features(model_dir, path) -> tuple[dict, bytes]:
    """`tessera encode-features` of one file into its folder: the JSON line it prints, and
    the feature file's bytes."""
    output = io.StringIO()
    with contextlib.redirect_stdout(output):
        assert encode_main(["--model", str(model_dir), "--output", str(path.parent),
                            str(path)]) == 0  # fmt: skip
    line = json.loads(output.getvalue().strip().splitlines()[-1])
    return line, path.with_suffix(".safetensors").read_bytes()


def test_a_picture_and_its_features_match_transformers(client, model_dir, tmp_path):
    reference = HFGreedy(model_dir)
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    image = picture(200, 136, 4)
    inputs = reference.inputs([{"role": "user", "content": [{"type": "image"}, QUESTION]}],
                              images=[image])  # fmt: skip
    expected = (inputs["input_ids"].shape[1], tokenizer.decode(reference.generate(inputs, NUM_NEW)))
    png = png_bytes(image)
    part = {"type": "image_url", "image_url": {"url": data_url(png, "image/png")}}
    assert answer(client, [part, QUESTION]) == expected
    (tmp_path / "picture.png").write_bytes(png)
    line, encoded = encode_features(model_dir, tmp_path / "picture.png")
    features = {"url": data_url(encoded), "grid_thw": line["grid_thw"]}
    assert answer(client, [{"type": "image_features", "image_features": features}, QUESTION]) == (
        expected
    )


def test_a_video_frame_by_frame_matches_transformers(client, model_dir, tmp_path):
    """A video_url, then the same video by its uuid alone (its frames' times remembered),
    then as the video_features `tessera encode-features` writes, with the times it prints
    (without them, or with too few, a 400 naming the field)."""
    reference = HFGreedy(model_dir)
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    clip = video_bytes(moving_pictures(96, 64, 19, salt=2), fps=4)  # 10 frames: 5 patches
    video = load_video(clip, VideoConfig.from_model_dir(model_dir))
    assert len(video.frame_seconds) == 5
    inputs = reference.inputs([{"role": "user", "content": [{"type": "video"}, QUESTION]}],
                              videos=[video])  # fmt: skip
    expected = (inputs["input_ids"].shape[1], tokenizer.decode(reference.generate(inputs, NUM_NEW)))
    part = {"type": "video_url", "video_url": {"url": data_url(clip, "video/mp4")}}
    assert answer(client, [{**part, "uuid": "clip-q3"}, QUESTION]) == expected
    assert answer(client, [{"type": "video_url", "uuid": "clip-q3"}, QUESTION]) == expected

    (tmp_path / "clip.mp4").write_bytes(clip)
    line, encoded = encode_features(model_dir, tmp_path / "clip.mp4")
    assert line["frame_seconds"] == list(video.frame_seconds)
    features = {"url": data_url(encoded), "grid_thw": line["grid_thw"],
                "frame_seconds": line["frame_seconds"]}  # fmt: skip
    content = [{"type": "video_features", "video_features": features}, QUESTION]
    assert answer(client, content) == expected
    for wrong in (None, line["frame_seconds"][:-1]):
        content[0]["video_features"] = {**features, "frame_seconds": wrong}
        with pytest.raises(openai.BadRequestError) as info:
            answer(client, content)
        assert info.value.body["param"] == "messages[0].content[0].video_features.frame_seconds"
        assert "one time per temporal patch (5 for grid_thw" in info.value.body["message"]
