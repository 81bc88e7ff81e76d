"""A request whose image arrives as fetched features survives preemption after its rows
were evicted from the encoder cache: the runner puts its own copy back (no refetch, no
error) and the completion equals the same request sent with the image's pixels."""

from __future__ import annotations

import msgspec
import torch

from bench.datasets import data_url
from engine import LLM, SamplingParams
from engine.encode_features import feature_file_bytes
from engine.multimodal.image_processor import process_image
from engine.protocol import FeatureSource
from engine.tiny_model import make_tiny_model
from tests.parity.test_generate import chat, picture

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
# The feature request comes last so that it is the preemption victim; the others bring
# new images whose encoding evicts its rows meanwhile.
IMAGES = [picture(140, 196, 2), picture(200, 90, 3), picture(140, 196, 7), picture(112, 84, 1)]


def feature_url(llm: LLM, image) -> str:
    processed = process_image(image, llm.image_config)
    runner = llm.engine.runner
    with torch.inference_mode():
        embeds = runner.model.encode_images(
            processed.pixel_values.to(runner.dtype), torch.tensor([processed.grid_thw])
        )  # [num_tokens, hidden]
    data = feature_file_bytes(embeds.float(), tuple(processed.grid_thw), "float32")
    return data_url(data)


def run(llm: LLM, with_feature: bool) -> list[list[int]]:
    prompts = [chat(image, "Describe it in detail.") for image in IMAGES]
    ids = []
    for index, prompt in enumerate(prompts):
        request, tensors, _ = llm._build_request(f"r{index}-{with_feature}", prompt, GREEDY)
        if with_feature and index == len(prompts) - 1:
            (media,) = request.media
            media = msgspec.structs.replace(
                media, pixel_values=None, feature=FeatureSource(feature_url(llm, IMAGES[-1]))
            )
            request, tensors = msgspec.structs.replace(request, media=[media]), []
        llm.engine.add_request(request, tensors)
        ids.append(request.request_id)
    tokens: dict[str, list[int]] = {i: [] for i in ids}
    llm.last_stats = []
    while llm.engine.has_unfinished_requests():
        step = llm.engine.step()
        llm.last_stats.append(step.stats)
        for output in step.outputs:
            assert output.error is None, output.error
            tokens[output.request_id] += output.new_token_ids
    return [tokens[i] for i in ids]


def test_fetched_features_survive_preemption_and_eviction(tmp_path):
    model_dir = str(make_tiny_model(tmp_path, seed=0, size="tiny"))
    reference = run(LLM(model_dir, num_kv_blocks=512), with_feature=False)
    llm = LLM(
        model_dir,
        num_kv_blocks=30,
        block_size=4,
        encoder_cache_tokens=35,
        enable_prefix_caching=False,
    )
    assert run(llm, with_feature=True) == reference
    assert sum(s.num_preemptions_total for s in llm.last_stats) > 0
