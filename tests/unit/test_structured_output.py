"""Structured outputs without a model: grammar checks, matchers on a generated tokenizer,
the sampler's masking, and the scheduler finishing a request whose grammar is complete."""

from __future__ import annotations

import json
import string

import pytest
import torch
from tokenizers import Tokenizer

from engine.errors import InvalidRequest
from engine.protocol import SamplingParams, StructuredOutput
from engine.sampler import Sampler, SamplingRow, apply_allowed_tokens
from engine.structured_output import GrammarCompiler, grammar_error
from engine.tiny_model import make_tiny_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("grammar_model"))


@pytest.fixture(scope="module")
def tokenizer(model_dir) -> Tokenizer:
    return Tokenizer.from_file(str(model_dir / "tokenizer.json"))


@pytest.fixture(scope="module")
def compiler(model_dir, tokenizer) -> GrammarCompiler:
    config = json.loads((model_dir / "config.json").read_text())
    eos = (tokenizer.token_to_id("<|im_end|>"),)
    return GrammarCompiler(str(model_dir / "tokenizer.json"), config["vocab_size"], eos)


def allowed_ids(mask: torch.Tensor) -> list[int]:
    return [t for t in range(mask.numel() * 32) if (int(mask[t // 32]) >> (t % 32)) & 1]


@pytest.mark.parametrize(
    "spec",
    [
        StructuredOutput(json='{"type": "object"}'),
        StructuredOutput(json='{"type": "array", "items": {"type": "integer"}}'),
        StructuredOutput(regex=r"[a-z]+@[a-z]+\.com"),
        StructuredOutput(choice=("yes", "no", 'say "maybe"')),
        StructuredOutput(json='{"oneOf": [{"type": "string"}, {"type": "integer"}]}'),
    ],
)
def test_good_specs_pass(spec):
    assert grammar_error(spec) is None


def test_bounds_past_what_llguidance_builds_move_in_on_their_open_side(compiler, tokenizer):
    """pydantic's int64 fields (ge=-2**63) and float32 ranges were a 400 (fuzz120: llguidance
    builds no regex for such a bound), which OpenAI's strict mode and vLLM take. Such a
    bound moves in to 9.2e18, so that answers stay within it (fuzz121: dropping it let a
    model write 22 digits); anywhere a schema sits, a property named "default" included
    (fuzz121: skipped as the keyword), but never inside a `const` value. A bound that far
    on its closed side still is a 400."""
    from engine.structured_output import OUTERMOST_BOUND, to_grammar

    int64 = {"type": "integer", "minimum": -(2**63), "maximum": 2**63 - 1}
    float32 = {"type": "number", "exclusiveMinimum": -3.4e38, "exclusiveMaximum": 3.4e38}
    row = {"type": "object", "properties": {"id": int64, "x": float32, "default": int64,
           "c": {"const": {"minimum": -1e30}}}, "required": ["id", "x", "default", "c"],
           "$defs": {"examples": {"anyOf": [int64]}}}  # fmt: skip
    assert grammar_error(StructuredOutput(json=json.dumps(row))) is None
    built = json.loads(to_grammar(StructuredOutput(json=json.dumps(row))))["grammars"][0]
    properties = built["json_schema"]["properties"]
    moved = {"type": "integer", "minimum": -OUTERMOST_BOUND, "maximum": OUTERMOST_BOUND}
    assert properties["id"] == properties["default"] == moved
    assert built["json_schema"]["$defs"]["examples"] == {"anyOf": [moved]}
    assert properties["x"] == {"type": "number", "exclusiveMinimum": -OUTERMOST_BOUND,
                               "exclusiveMaximum": OUTERMOST_BOUND}  # fmt: skip
    assert properties["c"] == {"const": {"minimum": -1e30}}
    matcher = compiler.matcher(StructuredOutput(json=json.dumps(int64)))
    for token_id in tokenizer.encode("-42", add_special_tokens=False).ids:
        assert matcher.accept(token_id)
    too_long = compiler.matcher(StructuredOutput(json=json.dumps(int64)))
    digits = tokenizer.encode("1" * 22, add_special_tokens=False).ids
    assert not all(too_long.accept(token_id) for token_id in digits)  # past 9.2e18
    huge_minimum = {"type": "integer", "minimum": 2**63}  # bounds every answer: kept
    assert "integer range" in grammar_error(StructuredOutput(json=json.dumps(huge_minimum)))
    # fuzz122: beside it the far maximum stays too, so the error names the client's bounds
    far_range = {"type": "number", "minimum": 1e20, "maximum": 1e30}
    assert str(OUTERMOST_BOUND) not in grammar_error(StructuredOutput(json=json.dumps(far_range)))
    at_edge = {"type": "integer", "minimum": OUTERMOST_BOUND, "exclusiveMaximum": 1e300}
    assert grammar_error(StructuredOutput(json=json.dumps(at_edge))) is None  # as sent (fuzz124)
    # and a key written with \u escapes is read as JSON reads it (fuzz122)
    escaped = '{"type": "integer", "\\u006dinimum": -9223372036854775808}'
    assert grammar_error(StructuredOutput(json=escaped)) is None


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        (StructuredOutput(json="{not json"), ""),
        (StructuredOutput(json='{"type": 5}'), "type"),
        (StructuredOutput(regex="a(b"), "unclosed group"),
        (StructuredOutput(json='{"not": {}}'), "not"),  # unimplemented: refused, not ignored
        (StructuredOutput(regex="\ud800"), "surrogates"),  # a lone surrogate from JSON
        (StructuredOutput(choice=()), "at least one"),
        (StructuredOutput(), "exactly one"),
        (StructuredOutput(regex="a", choice=("a",)), "exactly one"),
    ],
)
def test_bad_specs_say_why(spec, says):
    error = grammar_error(spec)
    assert error is not None and says in error


def test_one_string_is_not_a_list_of_choices():
    with pytest.raises(TypeError, match="list of strings"):
        StructuredOutput(choice="yes")  # ("y", "e", "s") before


@pytest.mark.parametrize("choice", [("yes", "no"), ["yes", "no"]])  # a list as HTTP takes it
def test_a_matcher_walks_a_choice_to_its_end(compiler, tokenizer, choice):
    matcher = compiler.matcher(StructuredOutput(choice=choice))
    text = ""
    while not matcher.is_complete:
        allowed = allowed_ids(matcher.allowed_tokens())
        assert allowed, text
        token_id = min(allowed)  # any allowed path must end in a choice
        assert matcher.accept(token_id)
        text += tokenizer.decode([token_id])
    assert text in ("yes", "no")


def test_a_regexs_digit_and_word_classes_are_ascii(compiler, tokenizer):
    """`\\d{3}` wrote Arabic-Indic and N'Ko digits: Rust regex syntax's \\d is Unicode. A
    JSON schema's pattern and vLLM's default backend take it as [0-9]."""
    for regex, first_chars in ((r"\d{3}", "0123456789"),
                               (r"\w+", string.ascii_letters + string.digits + "_")):  # fmt: skip
        matcher = compiler.matcher(StructuredOutput(regex=regex))
        firsts = {tokenizer.decode([t])[:1] for t in allowed_ids(matcher.allowed_tokens())}
        assert firsts and firsts <= set(first_chars), sorted(firsts - set(first_chars))


def test_a_token_outside_the_grammar_is_refused(compiler, tokenizer):
    matcher = compiler.matcher(StructuredOutput(json='{"type": "object"}'))
    mask = matcher.allowed_tokens()
    assert [tokenizer.decode([t]) for t in allowed_ids(mask)] == ["{"]
    assert mask.dtype == torch.int32 and mask.numel() == (1600 + 31) // 32
    assert not matcher.accept(tokenizer.encode("hello").ids[0])
    assert not matcher.is_complete and "satisfy the grammar" in matcher.error  # request fails


@pytest.mark.parametrize(
    "spec",
    [
        StructuredOutput(json='{"anyOf": [{"$ref": "#"}]}'),
        StructuredOutput(json='{"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}'),
        StructuredOutput(regex=r"[^\s\S]"),
    ],
)
def test_a_grammar_that_no_text_satisfies_is_refused_when_compiled(compiler, spec):
    """llguidance validates these; their first mask errs and allows only EOS, which ended
    the answer "stop" with an empty (so invalid) output."""
    assert grammar_error(spec) is None  # the server's check cannot tell
    with pytest.raises(InvalidRequest, match="no text can follow") as refused:
        compiler.matcher(spec)
    assert refused.value.param == "structured_output"


def test_a_grammar_that_finds_no_way_on_fails_its_request(compiler, tokenizer):
    """A property that must hold itself: the grammar lets '{"x": ' through, then allows only
    EOS, which it takes; the answer ended "stop" with '{"x": '. The scheduler now sees the
    error (tests/parity/test_structured_output_parity.py runs it through the engine)."""
    schema = {"type": "object", "properties": {"x": {"$ref": "#/properties/x"}}, "required": ["x"]}
    matcher = compiler.matcher(StructuredOutput(json=json.dumps(schema)))
    for token_id in tokenizer.encode('{"x": ', add_special_tokens=False).ids:
        assert matcher.accept(token_id)
    matcher.allowed_tokens()
    assert matcher.error is not None and "no text can follow" in matcher.error


def test_ids_past_the_tokenizer_are_never_allowed(compiler, tokenizer):
    """The logits are wider than the tokenizer (embedding padding rows)."""
    matcher = compiler.matcher(StructuredOutput(regex=".*"))
    allowed = allowed_ids(matcher.allowed_tokens())
    assert max(allowed) < tokenizer.get_vocab_size() < 1600


def test_sampler_masks_only_the_constrained_rows():
    logits = torch.tensor([[5.0, 1.0, 0.0, 2.0], [5.0, 1.0, 0.0, 2.0]])
    only_3 = torch.tensor([1 << 3], dtype=torch.int32)
    rows = [
        SamplingRow(SamplingParams(temperature=0.0), [1], [], allowed_tokens=only_3),
        SamplingRow(SamplingParams(temperature=0.0), [1], []),
    ]
    assert Sampler()(logits, rows).token_ids == [3, 0]
    masked = apply_allowed_tokens(logits, rows)
    assert torch.isinf(masked[0, :3]).all() and masked[0, 3] == 2.0
    assert torch.equal(masked[1], logits[1])


def test_sampler_masks_random_rows_too():
    torch.manual_seed(0)
    logits = torch.randn(64, 70)
    allowed = torch.zeros(3, dtype=torch.int32)
    allowed[2] = 1 << 1  # token 65 only
    rows = [SamplingRow(SamplingParams(temperature=1.0), [1], [], allowed_tokens=allowed)] * 64
    assert set(Sampler(seed=1)(logits, rows).token_ids) == {65}


def test_sampler_handles_the_sign_bit():
    """Token 31 of a word is its int32 sign bit."""
    logits = torch.zeros(1, 64)
    allowed = torch.tensor([-(2**31), 0], dtype=torch.int32)  # bit 31 of word 0
    rows = [SamplingRow(SamplingParams(temperature=0.0), [1], [], allowed_tokens=allowed)]
    assert Sampler()(logits, rows).token_ids == [31]


def test_warm_builds_the_tokenizer_view_ahead_and_a_missing_tokenizer_is_a_request_error(
    model_dir, tmp_path
):
    compiler = GrammarCompiler(str(model_dir / "tokenizer.json"), 1600, (1,))
    compiler.warm()
    assert compiler._tokenizer is not None  # the first matcher will not pay for it
    missing = GrammarCompiler(str(tmp_path / "tokenizer.json"), 1600, (1,))
    missing.warm()  # nothing to build: no error at start-up
    with pytest.raises(InvalidRequest, match="tokenizer.json"):
        missing.matcher(StructuredOutput(regex="a"))


def test_a_compiled_grammar_is_cached_and_each_request_gets_its_own_copy(model_dir, tokenizer):
    compiler = GrammarCompiler(str(model_dir / "tokenizer.json"), 1600, (1,), cache_size=2)
    spec = StructuredOutput(choice=("yes", "no"))
    assert compiler.cached(spec) is None
    first = compiler.matcher(spec)
    # The same grammar from another field (`param`) is the same entry.
    second = compiler.cached(StructuredOutput(choice=("yes", "no"), param="response_format"))
    assert second is not None
    yes = tokenizer.encode("yes").ids
    assert all(first.accept(t) for t in yes) and first.is_complete
    assert not second.is_complete  # a copy: the first one's tokens did not move it
    assert torch.equal(second.allowed_tokens(), compiler.matcher(spec).allowed_tokens())


def test_the_grammar_cache_keeps_the_most_recently_used(model_dir):
    compiler = GrammarCompiler(str(model_dir / "tokenizer.json"), 1600, (1,), cache_size=2)
    a, b, c = (StructuredOutput(regex=r) for r in ("a+", "b+", "c+"))
    compiler.matcher(a)
    compiler.matcher(b)
    assert compiler.cached(a) is not None  # a is now the most recent
    compiler.matcher(c)  # evicts b
    assert compiler.cached(b) is None
    assert compiler.cached(a) is not None and compiler.cached(c) is not None
    uncached = GrammarCompiler(str(model_dir / "tokenizer.json"), 1600, (1,), cache_size=0)
    uncached.matcher(a)
    assert uncached.cached(a) is None



def test_a_bad_regex_is_quoted_as_the_client_wrote_it():
    """Its error quoted the ASCII rewrite, [0-9] for the client's \\d (fuzz57)."""
    error = grammar_error(StructuredOutput(regex=r"\d+(\w"))
    assert error is not None and r"\d+(\w" in error and "[0-9]" not in error
