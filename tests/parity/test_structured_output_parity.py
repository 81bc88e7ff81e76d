"""Structured outputs against transformers: the same grammar masks applied inside
`generate()` by a logits processor (llguidance's own numpy helpers, not Tessera's sampler)
give the same greedy tokens, and the text matches its schema, regex or choice."""

from __future__ import annotations

import json
import re

import pytest

transformers = pytest.importorskip("transformers")
jsonschema = pytest.importorskip("jsonschema")

import llguidance  # noqa: E402
import llguidance.numpy  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402

from engine import LLM, SamplingParams, StructuredOutput  # noqa: E402
from engine.structured_output import to_grammar  # noqa: E402
from engine.tiny_model import make_tiny_model  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "ok": {"type": "boolean"},
        "name": {"type": "string", "maxLength": 6},
    },
    "required": ["color", "ok", "name"],
    "additionalProperties": False,
}
REGEX = r"(yes|no), [a-z]{2,5}\."
CHOICES = ("apple pie", "banana", "cherry tart")
# vLLM's `grammar` in llama.cpp's GBNF: a word, then one to three digits
GRAMMAR = 'root ::= ("cat" | "dog") " " [0-9] [0-9]? [0-9]?'
GRAMMAR_TEXT = r"(cat|dog) [0-9]{1,3}"
PROMPTS = ["the quick brown fox", "a b c d e f g h", "Describe the sea."]
MAX_TOKENS = 40


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("structured"), seed=3)


@pytest.fixture(scope="module")
def hf(model_dir):
    model = transformers.Qwen2VLForConditionalGeneration.from_pretrained(
        model_dir, dtype=torch.float32
    ).eval()
    return model, transformers.AutoTokenizer.from_pretrained(model_dir)


class GrammarLogitsProcessor:
    """The HF side: masks each row's logits with a llguidance matcher that has consumed
    the tokens generated so far."""

    def __init__(self, model_dir, spec: StructuredOutput, prompt_len: int, vocab: int):
        config = json.loads((model_dir / "generation_config.json").read_text())
        eos = config["eos_token_id"]
        text = Tokenizer.from_file(str(model_dir / "tokenizer.json")).to_str()
        tokenizer = llguidance.LLTokenizer(text, n_vocab=vocab, eos_token=eos)
        self.matcher = llguidance.LLMatcher(tokenizer, to_grammar(spec))
        self.prompt_len = prompt_len
        self.vocab = vocab

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        generated = input_ids[0, self.prompt_len :].tolist()
        if generated:
            assert self.matcher.consume_token(generated[-1])
        mask = llguidance.numpy.allocate_token_bitmask(1, self.vocab)
        llguidance.numpy.fill_next_token_bitmask(self.matcher, mask)
        logits = scores.numpy().copy()
        llguidance.numpy.apply_token_bitmask_inplace(logits, mask)
        return torch.from_numpy(logits)


def hf_tokens(model_dir, hf, prompt: str, spec: StructuredOutput) -> list[int]:
    model, tokenizer = hf
    ids = tokenizer(prompt, return_tensors="pt")
    prompt_len = ids["input_ids"].shape[1]
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    processor = GrammarLogitsProcessor(model_dir, spec, prompt_len, vocab)
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=MAX_TOKENS, do_sample=False,
                             logits_processor=[processor])  # fmt: skip
    return out[0, prompt_len:].tolist()


SPECS = {
    "json": StructuredOutput(json=json.dumps(SCHEMA)),
    "regex": StructuredOutput(regex=REGEX),
    "choice": StructuredOutput(choice=CHOICES),
    "grammar": StructuredOutput(grammar=GRAMMAR),
}


def check_text(kind: str, text: str) -> None:
    if kind == "json":
        jsonschema.validate(json.loads(text), SCHEMA)
    elif kind == "regex":
        assert re.fullmatch(REGEX, text), text
    elif kind == "grammar":
        assert re.fullmatch(GRAMMAR_TEXT, text), text
    else:
        assert text in CHOICES


@pytest.mark.parametrize("kind", sorted(SPECS))
def test_greedy_tokens_match_transformers_under_the_same_grammar(model_dir, hf, kind):
    spec = SPECS[kind]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, structured_output=spec)
    with LLM(str(model_dir), num_kv_blocks=64) as llm:
        results = llm.generate(PROMPTS, params)
    eos = set(llm_eos(model_dir))
    for prompt, result in zip(PROMPTS, results, strict=True):
        assert result.error is None
        assert result.finish_reason == "stop", result.text
        expected = hf_tokens(model_dir, hf, prompt, spec)
        # transformers goes on to sample EOS (the only token the grammar then allows);
        # Tessera finishes as soon as the grammar is complete. Where the grammar allows
        # more text or EOS, both pick EOS alike.
        assert result.token_ids == expected[: len(result.token_ids)]
        assert set(expected[len(result.token_ids) :]) <= eos
        check_text(kind, result.text)


def llm_eos(model_dir) -> list[int]:
    eos = json.loads((model_dir / "generation_config.json").read_text())["eos_token_id"]
    return eos if isinstance(eos, list) else [eos]


def test_sampled_rows_keep_to_the_grammar_beside_free_rows(model_dir):
    structured = SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=5,
                                structured_output=SPECS["json"])  # fmt: skip
    free = SamplingParams(max_tokens=8, temperature=1.0, seed=5, ignore_eos=True)
    with LLM(str(model_dir), num_kv_blocks=64) as llm:
        results = llm.generate(PROMPTS * 2, [structured, free] * 3)
    for result in results[::2]:
        assert result.finish_reason == "stop"
        check_text("json", result.text)
    assert all(len(result.token_ids) == 8 for result in results[1::2])
    # Unconstrained random rows of this tiny model are not JSON.
    assert not all(r.text.startswith("{") for r in results[1::2])


def test_a_bad_grammar_fails_its_request_only(model_dir):
    bad = SamplingParams(max_tokens=4, structured_output=StructuredOutput(regex="a(b"))
    good = SamplingParams(max_tokens=4, temperature=0.0)
    with LLM(str(model_dir), num_kv_blocks=64) as llm:
        failed, answered = llm.generate(PROMPTS[:2], [bad, good])
    assert failed.error is not None and failed.error.param == "structured_output"
    assert "regex" in failed.error.message
    assert answered.error is None and len(answered.token_ids) >= 1


def test_the_mask_is_what_llguidance_allows(model_dir):
    """Sanity of the helper the test leans on: the first token of a JSON object is '{'."""
    config = json.loads((model_dir / "config.json").read_text())
    processor = GrammarLogitsProcessor(model_dir, SPECS["json"], 0, config["vocab_size"])
    scores = torch.zeros(1, config["vocab_size"])
    masked = processor(torch.zeros(1, 0, dtype=torch.long), scores)
    allowed = np.flatnonzero(np.isfinite(masked.numpy()))
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    assert {tokenizer.decode([int(t)]) for t in allowed} == {"{"}


def test_overlap_scheduling_and_preemption_keep_to_the_grammar(model_dir):
    """A step is never launched ahead of a constrained row's token (its mask needs it), and
    a preempted request keeps its place in the grammar while its KV is recomputed."""
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0,
                            structured_output=SPECS["json"])  # fmt: skip
    prompts = [f"{prompt} {i}" for i in range(2) for prompt in PROMPTS]
    with LLM(str(model_dir), num_kv_blocks=64) as llm:
        reference = llm.generate(prompts, params)
    with LLM(str(model_dir), num_kv_blocks=10, max_num_batched_tokens=16,
             enable_prefix_caching=False) as llm:  # fmt: skip
        llm.engine.overlaps_steps = True
        results = llm.generate(prompts, params)
        stats = llm.last_stats
    assert sum(s.num_preemptions_total for s in stats) > 0
    assert [r.token_ids for r in results] == [r.token_ids for r in reference]
    for result in results:
        check_text("json", result.text)


def test_a_constrained_row_sits_out_steps_launched_ahead_for_the_rows_beside_it(
    model_dir, monkeypatch
):
    """Beside unconstrained rows, steps are launched ahead (they overlap); a constrained
    row is never scheduled while its token is in flight (its mask needs that token on the
    host), so it takes every other step. Every answer equals the serial loop's."""
    constrained = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0,
                                 structured_output=SPECS["json"])  # fmt: skip
    plain = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    prompts = PROMPTS[:3]
    params = [constrained, plain, plain]
    with LLM(str(model_dir), num_kv_blocks=64) as llm:
        reference = llm.generate(prompts, params)
    masked_with_a_token_in_flight, launched_ahead = [], []
    with LLM(str(model_dir), num_kv_blocks=64) as llm:
        llm.engine.overlaps_steps = True
        real_launch = llm.engine.launch_step

        def launch_step(previous=None):
            step = real_launch(previous)
            launched_ahead.append(previous is not None)
            masked_with_a_token_in_flight.extend(
                chunk.request.num_pending_tokens > 1 for chunk in step.scheduler_output.chunks
                if chunk.samples and chunk.request.sampling.structured_output is not None
            )  # fmt: skip
            return step

        monkeypatch.setattr(llm.engine, "launch_step", launch_step)
        results = llm.generate(prompts, params)
    assert [r.token_ids for r in results] == [r.token_ids for r in reference]
    check_text("json", results[0].text)
    assert sum(launched_ahead) >= MAX_TOKENS // 2
    assert masked_with_a_token_in_flight and not any(masked_with_a_token_in_flight)


def test_a_grammar_that_runs_out_of_its_limits_fails_only_its_request(model_dir):
    """`a{1000000}` passes the server's grammar-level check but needs more regex work than
    grammar_lexer_fuel allows: its request ends with an error naming it, and no token of
    it goes out; the request beside it is answered as without it."""
    hostile = SamplingParams(max_tokens=8, temperature=0.0,
                             structured_output=StructuredOutput(regex="a{1000000}"))  # fmt: skip
    plain = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    with LLM(str(model_dir), num_kv_blocks=64) as llm:
        alone = llm.generate(PROMPTS[:1], plain)
        failed, answered = llm.generate(PROMPTS[1::-1], [hostile, plain])
    assert failed.error is not None and failed.error.param == "structured_output"
    assert "grammar failed" in failed.error.message and failed.token_ids == []
    assert answered.token_ids == alone[0].token_ids


def test_grammars_that_no_text_satisfies_fail_instead_of_stopping(model_dir):
    """An empty language (a schema of only itself) is refused when compiled; a property that
    must hold itself is found out once the output reaches it. Both ended "stop" with an
    output the grammar does not accept ('' and '{"x": ')."""
    looping = {"type": "object", "properties": {"x": {"$ref": "#/properties/x"}},
               "required": ["x"]}  # fmt: skip
    specs = [StructuredOutput(json='{"anyOf": [{"$ref": "#"}]}'),
             StructuredOutput(json=json.dumps(looping))]  # fmt: skip
    with LLM(str(model_dir), num_kv_blocks=64) as llm:
        results = llm.generate(PROMPTS[:2], [SamplingParams(max_tokens=30, temperature=0.0,
                                                            structured_output=spec)
                                             for spec in specs])  # fmt: skip
    for result in results:
        assert result.error is not None and "no text can follow" in result.error.message
        assert result.finish_reason != "stop" and result.error.param == "structured_output"
    assert results[0].token_ids == []


@pytest.mark.parametrize("overlap", [False, True])
def test_a_grammar_after_a_marker_holds_from_there_on(model_dir, overlap):
    """`structured_output_after` (the end of a reasoning model's thinking): tokens before
    the marker, and the marker, are free; the grammar holds after it and ends the answer.
    The marker is one token here, forced first by a logit bias that the grammar then
    masks away."""
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    marker = tokenizer.token_to_id(".")
    digits = StructuredOutput(regex="[0-9]{3}")
    params = {"max_tokens": 12, "temperature": 0.0, "logit_bias": ((marker, 100.0),)}
    with LLM(str(model_dir), num_kv_blocks=64) as llm:
        llm.engine.overlaps_steps = overlap
        after, at_once, never = llm.generate(
            ["the quick brown fox"] * 3,
            [SamplingParams(structured_output=digits, structured_output_after=(marker,), **params),
             SamplingParams(structured_output=digits, **params),
             SamplingParams(structured_output=digits, structured_output_after=(0, 0), **params)],
        )  # fmt: skip
    assert after.token_ids[0] == marker and re.fullmatch("[0-9]{3}", after.text[1:])
    assert after.finish_reason == "stop" and len(after.token_ids) == 4
    assert re.fullmatch("[0-9]{3}", at_once.text) and marker not in at_once.token_ids
    # A marker that never comes leaves the answer free (here: the biased token throughout).
    assert never.token_ids == [marker] * 12 and never.finish_reason == "length"


def test_eos_waits_for_the_marker_that_a_grammar_follows(model_dir):
    """A model that ended (EOS) before writing the marker answered "stop" with no output
    in the requested format: EOS is now banned until the marker, as before min_tokens."""
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    marker = tokenizer.token_to_id(".")
    with LLM(str(model_dir), num_kv_blocks=64) as llm:
        eos = llm.engine.model_config.eos_token_ids[0]
        params = SamplingParams(max_tokens=6, temperature=0.0, logit_bias=((eos, 100.0),),
                                structured_output=StructuredOutput(regex="[0-9]{3}"),
                                structured_output_after=(marker,))  # fmt: skip
        [waited] = llm.generate(["the quick brown fox"], params)
    assert waited.error is None and eos not in waited.token_ids
    assert waited.finish_reason == "length" and len(waited.token_ids) == 6
