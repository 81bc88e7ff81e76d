"""A GBNF grammar is converted to Lark once, in the server's grammar check, and the engine
gets the Lark (fuzz119: llguidance's conversion is Python, quadratic in a chain of rules,
and ran again in the engine, holding its GIL ~2 s for a 32 KB chain)."""

from __future__ import annotations

import asyncio

import pytest

from server.openai_models import ChatCompletionRequest
from server.sampling_params import GrammarRefused, build_sampling_params, check_structured_output

GBNF = 'root ::= word (" " word)*\nword ::= "red" | "blue"'
LARK = 'start: "yes" | "no"'


def sampling_for(grammar: str):
    request = ChatCompletionRequest.model_validate({
        "model": "m", "messages": [{"role": "user", "content": "hi"}],
        "structured_outputs": {"grammar": grammar}})  # fmt: skip
    asyncio.run(check_structured_output(request))
    return build_sampling_params(request, num_prompt_tokens=4, max_model_len=64)


def test_the_engine_gets_gbnf_as_lark_and_lark_as_given():
    converted = sampling_for(GBNF).structured_output
    assert converted.grammar.startswith("%llguidance") and "root ::=" not in converted.grammar
    assert converted.param == "structured_outputs.grammar"
    assert sampling_for(LARK).structured_output.grammar == LARK


def test_a_gbnf_grammar_that_does_not_convert_is_a_400_naming_the_field():
    with pytest.raises(GrammarRefused) as refused:
        sampling_for("root ::= missing")
    assert refused.value.param == "structured_outputs.grammar"
    assert "'missing' not found" in refused.value.message
