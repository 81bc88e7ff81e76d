"""Prompt logprobs against transformers: the log-softmax of HF's logits at position t - 1
scores prompt token t; Tessera's scores (logprob, rank, top alternatives) are the same for
a text prompt and one with an image, whether the prompt runs in one chunk or many, is
preempted and recomputed, or would hit the prefix cache."""

from __future__ import annotations

import pytest

transformers = pytest.importorskip("transformers")

import torch  # noqa: E402

from bench.local_inputs import picture  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402
from engine.tiny_model import make_tiny_model  # noqa: E402
from tests.hf_reference import HFGreedy  # noqa: E402

NUM_TOP = 3
PARAMS = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True, prompt_logprobs=NUM_TOP)
TEXT = "Tell me a long story about " + "the sea and the wind and the rain " * 6


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("prompt_logprobs"), seed=5)


@pytest.fixture(scope="module")
def hf(model_dir):
    return HFGreedy(model_dir)


def prompts():
    image = picture(112, 84, 1)
    with_image = [{"type": "image", "image": image}, {"type": "text", "text": "What is this?"}]
    return [
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": TEXT}]}]}, []),
        ({"messages": [{"role": "user", "content": with_image}]}, [image]),
    ]


def hf_scores(hf, prompt, images) -> tuple[list[int], torch.Tensor]:
    parts = [{"type": p["type"], **({"text": p["text"]} if "text" in p else {})}
             for p in prompt["messages"][0]["content"]]  # fmt: skip
    inputs = hf.inputs([{"role": "user", "content": parts}], images=images)
    with torch.no_grad():
        logits = hf.model(**inputs).logits[0].float()  # [L, V]
    return inputs["input_ids"][0].tolist(), torch.log_softmax(logits, dim=-1)


def check(result, ids: list[int], logprobs: torch.Tensor) -> None:
    assert result.prompt_token_ids == ids
    scores = result.prompt_logprobs
    assert len(scores) == len(ids) - 1
    for t, score in enumerate(scores, start=1):
        row = logprobs[t - 1]
        assert score.token_id == ids[t]
        assert score.logprob == pytest.approx(row[ids[t]].item(), abs=1e-4)
        assert (
            score.rank == int((row >= row[ids[t]]).sum())  # vLLM's: ties count
            or abs(row.sort(descending=True).values[score.rank - 1] - row[ids[t]]) < 1e-5
        )  # a near-tie may rank one place apart
        top_values, top_ids = row.topk(NUM_TOP)
        assert [value for _, value in score.top] == pytest.approx(top_values.tolist(), abs=1e-4)
        assert [token for token, _ in score.top] == top_ids.tolist()


@pytest.mark.parametrize(
    "options",
    [
        {},  # one chunk per prompt
        {"max_num_batched_tokens": 16},  # many chunks, ending inside the image's span too
        {"max_num_batched_tokens": 16, "num_kv_blocks": 7},  # preempted and recomputed
    ],
    ids=["whole", "chunked", "preempted"],
)
def test_prompt_tokens_are_scored_as_transformers_scores_them(model_dir, hf, options):
    cases = prompts()
    with LLM(str(model_dir), **{"num_kv_blocks": 64, **options}) as llm:
        results = llm.generate([prompt for prompt, _ in cases], PARAMS)
        stats = llm.last_stats
    if "num_kv_blocks" in options:
        assert sum(s.num_preemptions_total for s in stats) > 0
    for result, (prompt, images) in zip(results, cases, strict=True):
        check(result, *hf_scores(hf, prompt, images))


def test_a_cached_prefix_is_scored_again_and_other_requests_still_hit_it(model_dir, hf):
    prompt, images = prompts()[0]
    with LLM(str(model_dir), num_kv_blocks=64) as llm:
        plain = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
        llm.generate([prompt], plain)  # fills the prefix cache
        [scored] = llm.generate([prompt], PARAMS)
        hits = sum(s.prefix_cache_hits_total for s in llm.last_stats)
        llm.generate([prompt], plain)
        later_hits = sum(s.prefix_cache_hits_total for s in llm.last_stats)
    check(scored, *hf_scores(hf, prompt, images))
    assert hits == 0 and later_hits > 0
    assert scored.token_ids == llm_tokens_without_scores(model_dir, prompt)


def llm_tokens_without_scores(model_dir, prompt) -> list[int]:
    with LLM(str(model_dir), num_kv_blocks=64) as llm:
        plain = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
        return llm.generate([prompt], plain)[0].token_ids


def test_a_negative_count_fails_only_its_request(model_dir):
    prompt, _ = prompts()[0]
    bad = SamplingParams(max_tokens=2, prompt_logprobs=-1)
    with LLM(str(model_dir), num_kv_blocks=64) as llm:
        failed, answered = llm.generate([prompt, prompt], [bad, PARAMS])
    assert failed.error is not None and failed.error.param == "prompt_logprobs"
    assert (
        answered.error is None
        and len(answered.prompt_logprobs) == len(answered.prompt_token_ids) - 1
    )
