"""Greedy generation through LLM / EngineCore equals transformers, token for token.

Three generated checkpoints of different seed and shape (the third is tests/gpu's). Every engine configuration
(single prompts, a batch of 8, a KV pool small enough to force preemption, tiny
prefill chunks) must reproduce HF's 32 greedy tokens, and chosen-token logprobs
within 1e-4 of log_softmax(HF output_logits).
"""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from bench.local_inputs import picture  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402
from engine.tiny_model import make_tiny_model  # noqa: E402

NUM_NEW = 32
GREEDY = SamplingParams(max_tokens=NUM_NEW, temperature=0.0, ignore_eos=True, logprobs=1)
VARIANTS = [("tiny", 0), ("tiny2", 1), ("tiny-hd128", 2)]  # tiny-hd128: tests/gpu's model


def chat(*parts) -> dict:
    content = [
        {"type": "text", "text": part}
        if isinstance(part, str)
        else {"type": "image", "image": part}
        for part in parts
    ]
    return {"messages": [{"role": "user", "content": content}]}


def make_prompts() -> list:
    image_a, image_b, image_c = picture(112, 84, 1), picture(140, 196, 2), picture(200, 90, 3)
    return [
        chat("Describe a dog in the park."),
        chat(image_a, "What is this?"),
        chat(image_a, "and", image_b, "Compare the two pictures."),
        "the quick brown fox jumps over the lazy dog",
        chat("Tell me a long story about " + "the sea and the wind and the rain " * 8),
        chat(image_c, "Describe it briefly."),
        chat("Hi"),
        chat("First", image_b, "then some words after the image to read."),
    ]


class Reference:
    """HF greedy continuations (and their chosen-token logprobs) of the prompts."""

    def __init__(self, model_dir):
        self.model_dir = model_dir
        self.model = transformers.Qwen2VLForConditionalGeneration.from_pretrained(
            model_dir, dtype=torch.float32
        ).eval()
        self.model.generation_config.eos_token_id = None  # 32 tokens, EOS or not
        self.tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
        self.image_processor = transformers.AutoImageProcessor.from_pretrained(model_dir)
        self._cache: dict[int, tuple[list[int], list[int], list[float]]] = {}

    def inputs(self, prompt) -> dict:
        if isinstance(prompt, str):
            ids = self.tokenizer(prompt, add_special_tokens=False, return_tensors="pt")
            return dict(ids)
        messages = [
            {
                **m,
                "content": [
                    {"type": p["type"], **({"text": p["text"]} if "text" in p else {})}
                    for p in m["content"]
                ],
            }
            for m in prompt["messages"]
        ]
        text = self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )
        images = [
            p["image"] for m in prompt["messages"] for p in m["content"] if p["type"] == "image"
        ]
        if not images:
            return dict(self.tokenizer(text, return_tensors="pt"))
        pixels = self.image_processor(images=images, return_tensors="pt")
        merge = self.image_processor.merge_size
        pieces = text.split("<|image_pad|>")
        expanded = pieces[0]
        for grid, piece in zip(pixels["image_grid_thw"], pieces[1:], strict=True):
            expanded += "<|image_pad|>" * (int(grid.prod()) // merge**2) + piece
        ids = self.tokenizer(expanded, return_tensors="pt")
        image_id = self.tokenizer.convert_tokens_to_ids("<|image_pad|>")
        # What Qwen2VLProcessor returns alongside input_ids; HF's M-RoPE needs it.
        mm_token_type_ids = (ids["input_ids"] == image_id).int()
        return {**ids, **pixels, "mm_token_type_ids": mm_token_type_ids}

    def get(self, index: int, prompt) -> tuple[list[int], list[int], list[float]]:
        """(prompt ids, 32 greedy tokens, chosen-token logprobs)."""
        if index not in self._cache:
            inputs = self.inputs(prompt)
            with torch.no_grad():
                out = self.model.generate(
                    **inputs,
                    max_new_tokens=NUM_NEW,
                    do_sample=False,
                    output_logits=True,
                    return_dict_in_generate=True,
                )
            prompt_ids = inputs["input_ids"][0].tolist()
            tokens = out.sequences[0, len(prompt_ids) :].tolist()
            logprobs = [
                torch.log_softmax(step[0].float(), -1)[t].item()
                for step, t in zip(out.logits, tokens, strict=True)
            ]
            self._cache[index] = (prompt_ids, tokens, logprobs)
        return self._cache[index]


@pytest.fixture(scope="module", params=VARIANTS, ids=[v[0] for v in VARIANTS])
def reference(request, tmp_path_factory):
    size, seed = request.param
    model_dir = make_tiny_model(tmp_path_factory.mktemp(f"gen_{size}"), seed=seed, size=size)
    return Reference(model_dir)


@pytest.fixture(scope="module")
def prompts():
    return make_prompts()


def check(results, reference, prompts, indices):
    for result, index in zip(results, indices, strict=True):
        prompt_ids, tokens, logprobs = reference.get(index, prompts[index])
        assert result.error is None, result.error
        assert result.prompt_token_ids == prompt_ids, f"prompt {index}: ids differ from HF's"
        assert result.token_ids == tokens, f"prompt {index}"
        assert result.finish_reason == "length"
        ours = [lp.logprob for lp in result.logprobs]
        assert np.allclose(ours, logprobs, atol=1e-4, rtol=0), f"prompt {index} logprobs"


def test_single_prompts(reference, prompts):
    llm = LLM(str(reference.model_dir), num_kv_blocks=128)
    for index in (0, 1, 2, 3):  # text, one image, two images of different sizes, raw text
        check(llm.generate([prompts[index]], GREEDY), reference, prompts, [index])
    assert len(set(reference.get(0, prompts[0])[1])) > 4  # a varied continuation


def test_batch_of_eight(reference, prompts):
    llm = LLM(str(reference.model_dir), num_kv_blocks=256)
    results = llm.generate(prompts, GREEDY)
    check(results, reference, prompts, range(len(prompts)))
    assert max(stats.num_running for stats in llm.last_stats) == len(prompts)


def test_preemption(reference, prompts):
    # 8 prompts need ~60 blocks of 16 at the end; 24 blocks force preemption.
    llm = LLM(str(reference.model_dir), num_kv_blocks=24, enable_prefix_caching=False)
    results = llm.generate(prompts, GREEDY)
    assert sum(stats.num_preemptions_total for stats in llm.last_stats) > 0
    check(results, reference, prompts, range(len(prompts)))


@pytest.mark.parametrize("budget,split_media", [(7, True), (16, False)])
def test_chunked_prefill(reference, prompts, budget, split_media):
    llm = LLM(
        str(reference.model_dir),
        num_kv_blocks=256,
        max_num_batched_tokens=budget,
        split_media=split_media,
    )
    indices = [0, 2, 5, 7]
    results = llm.generate([prompts[i] for i in indices], GREEDY)
    assert max(stats.num_scheduled_tokens for stats in llm.last_stats) <= max(budget, 64)
    check(results, reference, prompts, indices)


def test_bad_inputs_fail_alone(reference, prompts):
    llm = LLM(str(reference.model_dir), num_kv_blocks=256, max_model_len=200)
    image_id = reference.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    corrupt = io.BytesIO()
    picture(64, 64, 4).save(corrupt, format="PNG")
    http_image = {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}
    bad_data_url = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    bad = [
        list(range(10, 250)),  # longer than the context
        [5, 6, image_id, image_id, 7],  # placeholders without media
        "typed <|image_pad|> placeholder",  # placeholder typed into text
        chat(corrupt.getvalue()[:60], "truncated image"),  # corrupt image bytes
        {"messages": [{"role": "user", "content": [bad_data_url, {"type": "text", "text": "?"}]}]},
        {"messages": [{"role": "user", "content": [http_image, {"type": "text", "text": "?"}]}]},
    ]
    batch = [prompts[0], *bad, prompts[1]]
    results = llm.generate(batch, GREEDY)
    check([results[0], results[-1]], reference, prompts, [0, 1])
    codes = [r.error.code if r.error else None for r in results[1:-1]]
    assert codes[:5] == ["context_length_exceeded", "invalid_media", "invalid_media",
                         "invalid_media", "invalid_media"]  # fmt: skip
    assert all(r.finish_reason == "error" and r.token_ids == [] for r in results[1:-1])
    assert "240" in results[1].error.message and "200" in results[1].error.message
    assert results[5].error.param == "messages[0].content[0]"
    fetched = results[6].error  # a URL to fetch: the server's work
    assert fetched.param == "messages[0].content[0]" and fetched.status == 400
    assert "image_url part with a data: URL" in fetched.message


def test_chat_takes_image_url_parts_with_data_urls(reference, prompts):
    """OpenAI's image_url form with a data: URL, as vLLM's LLM.chat takes it: the same
    answer as the image's bytes (it was refused as "the HTTP API's")."""
    image = io.BytesIO()
    picture(56, 84, 7).save(image, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(image.getvalue()).decode()
    as_bytes = [{"role": "user", "content": [{"type": "image", "image": image.getvalue()},
                                             {"type": "text", "text": "What is it?"}]}]  # fmt: skip
    as_url = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                           {"type": "text", "text": "What is it?"}]}]  # fmt: skip
    with LLM(str(reference.model_dir), num_kv_blocks=256) as llm:
        first, second = llm.chat([as_bytes, as_url], GREEDY, raise_on_error=True)
    assert first.token_ids == second.token_ids and len(first.token_ids) == GREEDY.max_tokens


def test_malformed_prompts_and_sampling_fail_alone(reference, prompts):
    """Offline inputs the HTTP API's models would refuse: a malformed part raised from
    generate() (AttributeError) and a bad seed failed every request of its step."""
    llm = LLM(str(reference.model_dir), num_kv_blocks=256)
    malformed = [
        {"messages": [{"role": "user", "content": [{"type": "image", "image": None}]}]},
        {"messages": [{"role": "user", "content": [{"type": "image", "image": "cat.png"}]}]},
        {"messages": "hello"},
        {"messages": [{"role": "user", "content": [{"type": "video", "video": None}]}]},
    ]
    results = llm.generate([prompts[0], *malformed, prompts[1]], GREEDY)
    check([results[0], results[-1]], reference, prompts, [0, 1])
    params = [r.error.param if r.error else None for r in results[1:-1]]
    assert params == ["messages[0].content[0]", "messages[0].content[0]", "messages",
                      "messages[0].content[0]"]  # fmt: skip
    bad_sampling = [
        SamplingParams(max_tokens=4, seed="x"),
        SamplingParams(max_tokens=4, seed=2**70),
        SamplingParams(max_tokens=4, temperature=float("nan")),
        SamplingParams(max_tokens=4, temperature=-1.0),
        SamplingParams(max_tokens=4, top_p=2.0),
        SamplingParams(max_tokens=4, top_k=-5),
        SamplingParams(max_tokens=4, repetition_penalty=0.0),
    ]
    batch = [prompts[0]] * (len(bad_sampling) + 1)
    results = llm.generate(batch, [GREEDY, *bad_sampling])
    check([results[0]], reference, prompts, [0])
    params = [r.error.param if r.error else None for r in results[1:]]
    assert params == ["seed", "seed", "temperature", "temperature", "top_p", "top_k",
                      "repetition_penalty"]  # fmt: skip


def test_prefix_cache(reference, prompts):
    # block_size 4: the shared system prompt fills blocks, so requests of the same step
    # share them; the second generate() finds every prompt cached.
    llm = LLM(str(reference.model_dir), num_kv_blocks=1024, block_size=4)
    indices = [0, 1, 2, 6]
    for _ in range(2):
        results = llm.generate([prompts[i] for i in indices], GREEDY)
        check(results, reference, prompts, indices)
        assert sum(stats.prefix_cache_hits_total for stats in llm.last_stats) > 0
    hits = sum(stats.prefix_cache_hits_total for stats in llm.last_stats)
    queries = sum(stats.prefix_cache_queries_total for stats in llm.last_stats)
    assert hits >= queries - 4 * len(indices) * 2  # nearly all of the repeated prompts


def test_seeded_sampling_ignores_the_batch(reference, prompts):
    llm = LLM(str(reference.model_dir), num_kv_blocks=256)
    seeded = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, seed=1234)
    alone = llm.generate([prompts[1]], seeded)[0].token_ids
    other = SamplingParams(max_tokens=12, temperature=1.0)
    batch = llm.generate([prompts[0], prompts[1], prompts[6]], [other, seeded, other])
    assert batch[1].token_ids == alone
    reseeded = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, seed=99)
    assert llm.generate([prompts[1]], reseeded)[0].token_ids != alone


def test_encoder_failure_fails_only_its_request(reference, prompts, monkeypatch):
    from engine.multimodal.image_processor import ImageProcessorConfig, process_image

    llm = LLM(str(reference.model_dir), num_kv_blocks=256)
    model = llm.engine.runner.model
    encode = model.encode_images
    config = ImageProcessorConfig.from_model_dir(reference.model_dir)
    bad_grid = list(process_image(picture(200, 90, 3), config).grid_thw)  # prompts[5]'s image

    def flaky_encode(pixel_values, grid_thw):
        if bad_grid in grid_thw.tolist():
            raise RuntimeError("simulated encoder failure")
        return encode(pixel_values, grid_thw)

    monkeypatch.setattr(model, "encode_images", flaky_encode)
    results = llm.generate([prompts[1], prompts[5], prompts[0]], GREEDY)
    assert results[1].finish_reason == "error" and results[1].error.status == 500
    check([results[0], results[2]], reference, prompts, [1, 0])


def test_logit_bias_comes_before_the_repetition_penalty_as_in_transformers(reference, prompts):
    """transformers adds `sequence_bias` before its repetition penalty divides (vLLM too).
    The bias is chosen so the order decides the first token: added after the penalty (as
    Tessera did), it lifts a prompt token t above the best one; added before, it does not:
    (l_t + b) / r < best < l_t / r + b."""
    inputs = reference.inputs(prompts[3])
    prompt_ids = inputs["input_ids"][0].tolist()
    with torch.no_grad():
        logits = reference.model(**inputs).logits[0, -1]
    penalty = 2.0
    held = torch.zeros_like(logits, dtype=torch.bool)
    held[prompt_ids] = True
    penalised = torch.where(held, torch.where(logits > 0, logits / penalty, logits * penalty),
                            logits)  # fmt: skip
    best = penalised.max().item()
    token = max((t for t in set(prompt_ids) if logits[t] > 0 and penalised[t] < best),
                key=lambda t: logits[t].item())  # fmt: skip
    low, high = best - logits[token].item() / penalty, penalty * best - logits[token].item()
    bias = round((low + high) / 2, 3)
    with torch.no_grad():
        out = reference.model.generate(
            **inputs, max_new_tokens=NUM_NEW, do_sample=False, repetition_penalty=penalty,
            sequence_bias={(token,): bias},
        )  # fmt: skip
    expected = out[0, -NUM_NEW:].tolist()
    assert expected[0] != token
    llm = LLM(str(reference.model_dir), num_kv_blocks=256)
    params = SamplingParams(max_tokens=NUM_NEW, temperature=0.0, ignore_eos=True,
                            repetition_penalty=penalty, logit_bias=((token, bias),))  # fmt: skip
    [result] = llm.generate([prompts[3]], params)
    assert result.token_ids == expected


def test_logit_bias_matches_transformers_sequence_bias(reference, prompts):
    """OpenAI's logit_bias against transformers' single-token `sequence_bias` (added to the
    logits before the greedy pick): banning a token the model would pick changes the rest
    of the output the same way; an out-of-vocabulary id fails its request alone."""
    _, tokens, _ = reference.get(0, prompts[0])
    banned = tokens[0]
    with torch.no_grad():
        out = reference.model.generate(
            **reference.inputs(prompts[0]), max_new_tokens=NUM_NEW, do_sample=False,
            sequence_bias={(banned,): -100.0},
        )  # fmt: skip
    expected = out[0, -NUM_NEW:].tolist()
    assert banned not in expected
    llm = LLM(str(reference.model_dir), num_kv_blocks=256)
    vocab = llm.engine.model_config.vocab_size
    biased = SamplingParams(max_tokens=NUM_NEW, temperature=0.0, ignore_eos=True,
                            logit_bias=((banned, -100.0),))  # fmt: skip
    out_of_vocab = SamplingParams(max_tokens=4, logit_bias=((vocab, 1.0),))
    results = llm.generate([prompts[0], prompts[1], prompts[0]], [biased, out_of_vocab, GREEDY])
    assert results[0].token_ids == expected
    assert results[1].error.param == "logit_bias" and results[1].token_ids == []
    check(results[2:], reference, prompts, [0])


def test_prefix_cache_queries_count_only_lookups_that_happen(reference, prompts):
    """With caching off every prompt token counted as a query that missed (a 0% hit rate
    on dashboards where there is no cache), and so did a prompt scored for its logprobs,
    which never reads the cache. vLLM counts neither."""

    def queries(llm, sampling):
        llm.generate([prompts[0]], sampling)
        return sum(stats.prefix_cache_queries_total for stats in llm.last_stats)

    uncached = LLM(str(reference.model_dir), num_kv_blocks=256, enable_prefix_caching=False)
    assert queries(uncached, GREEDY) == 0
    cached = LLM(str(reference.model_dir), num_kv_blocks=256)
    scored = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=1)
    assert queries(cached, scored) == 0
    assert queries(cached, GREEDY) > 0
