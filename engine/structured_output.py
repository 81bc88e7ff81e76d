"""Structured outputs: a request's tokens constrained to a grammar, with llguidance.

A request's `SamplingParams.structured_output` names a JSON Schema (OpenAI's
`response_format`), a regular expression, a list of choices or a Lark / GBNF grammar
(vLLM's `structured_outputs`). The engine turns it into one `GrammarMatcher` per request; every
step that samples for the request

    matcher.allowed_tokens()  -> a bitmask over the vocabulary, [ceil(V / 32)] int32,
                                 bit t of word t // 32 set = token t may come next
    sampler                   -> logits of the other tokens set to -inf, then sampled
    matcher.accept(token)     -> the grammar advances (scheduler.update)

and once the grammar is complete (`is_complete`: nothing but EOS may follow) the request
finishes with "stop", whether or not EOS was sampled; a grammar that fails on the way
(`error`: out of its limits, or no allowed token left) fails its request. The next token's
mask needs this one, so such a request sits out the step launched ahead of it (it takes
every other step), and a step whose sampling rows all need their token on the host is not
launched ahead (engine/core.py, overlap scheduling).

The server checks a spec with `grammar_error` before sending it, so a bad schema or regex
is a 400 there; the engine checks again for the offline `LLM`. The tokenizer's view that
llguidance needs (each token's bytes) is built once per engine, on a thread at start-up
(`GrammarCompiler.warm`). Grammars are compiled off the engine loop too
(engine/grammar_admission.py) and kept, so a repeated spec costs a copy (microseconds).
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, TypeVar

import llguidance
import msgspec
import numpy as np
import torch
from llguidance.gbnf_to_lark import any_to_lark

from engine.errors import InvalidRequest, TesseraError
from engine.protocol import StructuredOutput

# The server's grammar-level checks (no tokenizer) take llguidance's default limits; the
# engine's matchers take `parser_limits(EngineConfig.grammar_lexer_fuel)`.
PARSER_LIMITS = llguidance.LLParserLimits()
# llguidance builds a grammar recursively, up to ~140 bytes of stack per character of a
# chain of rules or $refs: a 67 KB Lark chain of 3000 rules, or a 75 KB schema of 1000
# chained $refs, overflowed a thread's 8 MB and killed the process (fuzz118). Builds run on
# a thread with this much stack (address space: only the pages used become memory), and
# the server bounds a schema's and a grammar's size (--max-structured-output-schema-chars,
# 512 KiB: ~70 MB at worst) so that none needs more.
GRAMMAR_STACK_BYTES = 512 * 1024**2
_STACK_SIZE_LOCK = threading.Lock()
T = TypeVar("T")


def parser_limits(lexer_fuel: int) -> llguidance.LLParserLimits:
    """llguidance's limits with `lexer_fuel` for building a grammar's regular expressions:
    at its default (1M) the regex `a{1000000}` stalled the engine loop ~300 ms before
    failing; at 100k, 13 ms, while schemas of 20 x 50 properties still build (measured on
    a synthetic 152k vocabulary). Short error messages: they go back to the client."""
    return llguidance.LLParserLimits(initial_lexer_fuel=lexer_fuel, verbose_errors=False)


# llguidance's JSON compile options; a schema's "x-guidance" object overrides them.
# JSON as json.dumps writes it, with no whitespace elsewhere: llguidance's default lets a
# model pad JSON with whitespace, and weak models then spend max_tokens on it. oneOf is
# taken as anyOf (as llguidance suggests; pydantic writes oneOf for tagged unions) rather
# than refused.
JSON_OPTIONS = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
    "coerce_one_of": True,
}


def lark_grammar(text: str) -> str:
    """A `grammar` spec's text as Lark: as given, or converted from GBNF. The conversion is
    llguidance's Python, quadratic in a chain of rules' length (2 s for 32 KB, holding the
    GIL: fuzz119), so the server converts once, in its grammar check, and sends the engine
    Lark (`lark_spec`). ValueError when GBNF does not convert."""
    try:
        return any_to_lark(text)
    except Exception as exc:  # noqa: BLE001 - its parser raises its own and plain ones
        raise ValueError(f"Failed to convert the grammar from GBNF to Lark: {exc}") from None


def lark_spec(spec: StructuredOutput) -> StructuredOutput:
    """`spec` with a GBNF grammar converted to Lark (the same spec otherwise)."""
    if spec.grammar is None:
        return spec
    lark = lark_grammar(spec.grammar)
    return spec if lark == spec.grammar else msgspec.structs.replace(spec, grammar=lark)


def to_grammar(spec: StructuredOutput) -> str:
    """The llguidance grammar text of `spec`. Raises ValueError where the spec is not
    even well formed (a schema that is not JSON, not exactly one constraint, no choices)."""
    given = [spec.json, spec.regex, spec.choice, spec.grammar]
    if sum(part is not None for part in given) != 1:
        raise ValueError("set exactly one of json, regex, choice and grammar")
    if spec.grammar is not None:  # Lark, or GBNF (llama.cpp's) turned into Lark
        return llguidance.LLMatcher.grammar_from_lark(lark_grammar(spec.grammar))
    if spec.json is not None:
        schema = _with_outermost_bounds_moved_in(spec.json)
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
    if spec.regex is not None:
        # \d and \w as ASCII, as in a JSON schema's pattern here and in xgrammar (vLLM's
        # default): llguidance's Rust regex syntax takes them as Unicode (fuzz53).
        ascii_classes = llguidance.regex_to_lark(spec.regex, "dw")
        return llguidance.LLMatcher.grammar_from_regex(ascii_classes)
    if not spec.choice:
        raise ValueError("choice needs at least one string")
    # A Lark rule of string literals; json.dumps quotes and escapes each one.
    return llguidance.LLMatcher.grammar_from_lark(
        "start: " + " | ".join(json.dumps(choice) for choice in spec.choice)
    )


# llguidance writes a number's bounds as a regular expression, and fails on a bound far
# out on its open side: pydantic's int64 fields (ge=-2**63) and float32 ranges (3.4e38)
# were a 400 (fuzz120), which OpenAI's strict mode and vLLM take. Such a bound is moved in
# to OUTERMOST_BOUND, which llguidance builds (as it does every bound up to 2**63 - 1024 on
# that side): the answer stays within the client's bound, less only the numbers beyond
# 9.2e18 (dropping the bound let a model write 22 digits: fuzz121). A bound far out on its
# closed side (a minimum above ~1e17) is left as it is, and llguidance refuses it.
OUTERMOST_BOUND = 9_200_000_000_000_000_000
_LOWER_BOUNDS = ("minimum", "exclusiveMinimum")
_UPPER_BOUNDS = ("maximum", "exclusiveMaximum")
_LITERAL_KEYWORDS = ("const", "enum", "default", "examples")  # values, not schemas
# Keywords whose mapping's keys are names (a property named "default"), its values schemas
_NAMED_SCHEMAS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def _with_outermost_bounds_moved_in(schema_text: str) -> str:
    """`schema_text` with every numeric bound past OUTERMOST_BOUND on its open side moved
    in to it; the text itself when there is none."""
    keys = (*_LOWER_BOUNDS, *_UPPER_BOUNDS)
    if "\\u" not in schema_text and not any(key in schema_text for key in keys):
        return schema_text  # (a key may be written with \u escapes: fuzz122)
    try:
        schema = json.loads(schema_text)
        moved = _moved_in(schema)
    except (ValueError, RecursionError):
        return schema_text  # llguidance says what is wrong with the text, or how deep it is
    return schema_text if moved == schema else json.dumps(moved)


def _moved_in(schema: Any) -> Any:
    """A schema (or a list of them) with its far bounds moved in, recursively."""
    if isinstance(schema, list):
        return [_moved_in(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    # Beside a bound at or past OUTERMOST_BOUND on its closed side none moves: the bounds
    # stay the client's, in an error too (fuzz122: "maximum (9200000000000000000)", never
    # sent; fuzz124: a minimum of exactly 9.2e18 met a maximum moved onto it).
    lower = [v for k, v in schema.items() if k in _LOWER_BOUNDS and _is_number(v)]
    upper = [v for k, v in schema.items() if k in _UPPER_BOUNDS and _is_number(v)]
    refused = any(v >= OUTERMOST_BOUND for v in lower) or any(v <= -OUTERMOST_BOUND for v in upper)
    moved = {}
    for key, value in schema.items():
        if key in _LITERAL_KEYWORDS or (refused and key in (*_LOWER_BOUNDS, *_UPPER_BOUNDS)):
            moved[key] = value
        elif key in _NAMED_SCHEMAS and isinstance(value, dict):
            moved[key] = {name: _moved_in(sub) for name, sub in value.items()}
        elif _is_number(value) and key in _LOWER_BOUNDS:
            moved[key] = max(value, -OUTERMOST_BOUND)
        elif _is_number(value) and key in _UPPER_BOUNDS:
            moved[key] = min(value, OUTERMOST_BOUND)
        else:
            moved[key] = _moved_in(value)
    return moved


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def grammar_error(spec: StructuredOutput) -> str | None:
    """Why `spec` cannot constrain a request, or None when it can."""
    return on_grammar_stack(lambda: _grammar_error(spec))


def _grammar_error(spec: StructuredOutput) -> str | None:
    try:
        if spec.regex is not None:
            # the client's own regex first, so that an error quotes it rather than its
            # ASCII rewrite ([0-9] for \d)
            as_given = _validation_error(llguidance.LLMatcher.grammar_from_regex(spec.regex))
            if as_given is not None:
                return as_given
        grammar = to_grammar(spec)
    except ValueError as exc:
        return str(exc)
    return _validation_error(grammar)


def _validation_error(grammar: str) -> str | None:
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
        grammar, limits=PARSER_LIMITS
    )
    return messages[0] if is_error else None


class GrammarMatcher:
    """One request's position in its grammar (not thread-safe; the engine loop owns it)."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int) -> None:
        self._matcher = matcher
        self._num_words = (vocab_size + 31) // 32

    def allowed_tokens(self) -> torch.Tensor:
        """[ceil(V / 32)] int32 on the host: bit t % 32 of word t // 32 allows token t."""
        words = np.frombuffer(self._matcher.compute_bitmask(), dtype=np.int32)
        return torch.from_numpy(words[: self._num_words].copy())

    def accept(self, token_id: int) -> bool:
        """Advances past `token_id`; False (and `error` set) if the grammar could not take
        it: a token it did not allow, or a grammar that ran out of its limits."""
        return self._matcher.consume_token(token_id)

    @property
    def is_complete(self) -> bool:
        """The grammar is satisfied and allows nothing but EOS from here."""
        return self._matcher.is_stopped() and not self._matcher.is_error()

    @property
    def error(self) -> str | None:
        """Why the grammar failed (its first line), or None."""
        if not self._matcher.is_error():
            return None
        return _readable(self._matcher.get_error())


# llguidance's name for a state from which no token leads anywhere the grammar accepts.
_NO_WAY_ON = "NoExtensionBias"


def _readable(error: str) -> str:
    """The first line of a matcher's error, in words where llguidance's are a name."""
    first = error.strip().splitlines()[0][:300] if error.strip() else "failed"
    if first == _NO_WAY_ON:
        return "no text can follow: the grammar allows nothing that it could finish"
    return first


SpecKey = tuple[str | None, str | None, tuple[str, ...] | None, str | None]


def spec_key(spec: StructuredOutput) -> SpecKey:
    """What makes two specs the same grammar (not `param`, which only names the field)."""
    return (spec.json, spec.regex, spec.choice, spec.grammar)


def on_grammar_stack(build: Callable[[], T]) -> T:
    """`build()` run on a fresh thread of GRAMMAR_STACK_BYTES of stack: its result, or what
    it raised."""
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["result"] = build()
        except BaseException as exc:  # noqa: BLE001 - re-raised on the caller's thread
            outcome["error"] = exc

    # threading.stack_size is the process's: set around this one start (a thread another
    # module starts meanwhile gets the large stack too, address space only).
    with _STACK_SIZE_LOCK:
        previous = threading.stack_size(GRAMMAR_STACK_BYTES)
        try:
            thread = threading.Thread(target=run, name="grammar-build", daemon=True)
            thread.start()
        except RuntimeError as exc:  # no room for the stack (a tight `ulimit -v`)
            # Not on the caller's stack: a chain the limits allow then crashed the engine
            # (fuzz122), where this fails the request alone.
            raise TesseraError(
                f"a grammar build needs a {GRAMMAR_STACK_BYTES >> 20} MiB thread stack, which "
                f"this process cannot have ({exc}; is `ulimit -v` set?)",
                code="grammar_stack_unavailable",
            ) from None
        finally:
            threading.stack_size(previous)
    thread.join()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["result"]


class GrammarCompiler:
    """Makes `GrammarMatcher`s for one model: its tokenizer (read from `tokenizer.json` on
    first use), its logits' width and its EOS tokens. The last `cache_size` compiled
    grammars are kept: a request with the same spec gets a copy (`cached`).

    `matcher` (compiling: about 1 ms for a small JSON schema, 20-50 ms for a large one) is
    meant for a worker thread, `cached` for the engine loop; both are thread-safe."""

    def __init__(
        self,
        tokenizer_json: str,
        vocab_size: int,
        eos_token_ids: tuple[int, ...],
        limits: llguidance.LLParserLimits = PARSER_LIMITS,
        cache_size: int = 0,
    ):
        self._tokenizer_json = tokenizer_json
        self._vocab_size = vocab_size
        self._eos_token_ids = list(eos_token_ids)
        self._limits = limits
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()  # the tokenizer view is built once
        self._cache_size = cache_size
        # Compiled grammars, least recently used first. Nothing consumes a token on these;
        # they are only copied, which llguidance allows from any thread.
        self._compiled: OrderedDict[SpecKey, llguidance.LLMatcher] = OrderedDict()
        self._cache_lock = threading.Lock()

    def _compile(self, spec: StructuredOutput, tokenizer: llguidance.LLTokenizer):
        """`spec`'s llguidance matcher, its first mask computed (on the grammar stack)."""
        try:
            grammar = to_grammar(spec)
        except ValueError as exc:
            raise InvalidRequest(f"invalid structured output: {exc}", param=spec.param) from exc
        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0, limits=self._limits)
        if matcher.is_error():
            message = matcher.get_error()[:500]
            raise InvalidRequest(f"invalid structured output: {message}", param=spec.param)
        # The first mask builds the lexer's states for the grammar's start (~5 ms for a
        # large schema); copies of this matcher keep them, so their first mask on the
        # engine loop takes ~0.2 ms. A grammar that fails here fails its request there.
        matcher.compute_bitmask()
        if matcher.is_error():  # a grammar that no text satisfies (a schema of only itself)
            message = _readable(matcher.get_error())
            raise InvalidRequest(f"invalid structured output: {message}", param=spec.param)
        return matcher

    def _llg_tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._tokenizer is None:
                try:
                    with open(self._tokenizer_json, encoding="utf-8") as file:
                        text = file.read()
                except FileNotFoundError as exc:
                    raise InvalidRequest(
                        "structured outputs need the model's tokenizer.json"
                    ) from exc
                # n_vocab = the logits' width: ids past the tokenizer's (padding rows of
                # the embedding) have no bytes and are never allowed.
                self._tokenizer = llguidance.LLTokenizer(
                    text, n_vocab=self._vocab_size, eos_token=self._eos_token_ids
                )
            return self._tokenizer

    def warm(self) -> None:
        """Builds the tokenizer's view now (about 0.6 s for a 152k vocabulary, measured with
        a synthetic one): the engine calls it on a thread at start-up, so that the first
        structured request does not wait for it."""
        try:
            self._llg_tokenizer()
        except InvalidRequest:
            pass  # no tokenizer.json: the first structured request gets the error

    def cached(self, spec: StructuredOutput) -> GrammarMatcher | None:
        """A fresh matcher for `spec` copied from its compiled grammar, or None when it has
        not been compiled (or has been evicted since)."""
        key = spec_key(spec)
        with self._cache_lock:
            compiled = self._compiled.get(key)
            if compiled is None:
                return None
            self._compiled.move_to_end(key)
        return GrammarMatcher(compiled.deep_copy(), self._vocab_size)

    def matcher(self, spec: StructuredOutput) -> GrammarMatcher:
        """A fresh matcher for `spec`, compiled unless cached; InvalidRequest when the
        grammar is unusable."""
        cached = self.cached(spec)
        if cached is not None:
            return cached
        tokenizer = self._llg_tokenizer()
        matcher = on_grammar_stack(lambda: self._compile(spec, tokenizer))
        if self._cache_size <= 0:
            return GrammarMatcher(matcher, self._vocab_size)
        with self._cache_lock:
            self._compiled[spec_key(spec)] = matcher
            while len(self._compiled) > self._cache_size:
                self._compiled.popitem(last=False)
        return GrammarMatcher(matcher.deep_copy(), self._vocab_size)
