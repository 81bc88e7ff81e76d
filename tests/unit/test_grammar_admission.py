"""Grammars compile off the engine loop: a request waits in COMPILING while the other
requests keep decoding, a repeated spec is copied from the cache without waiting, and an
abort or an unusable grammar ends only its request."""

from __future__ import annotations

import threading

import msgspec
import pytest

from engine import LLM, SamplingParams, StructuredOutput
from engine.protocol import EngineRequest, FinishReason
from engine.tiny_model import make_tiny_model

SPEC = StructuredOutput(json='{"type": "object", "properties": {"a": {"type": "integer"}}}')
STRUCTURED = SamplingParams(max_tokens=24, temperature=0.0, structured_output=SPEC)
PLAIN = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    with LLM(str(make_tiny_model(tmp_path_factory.mktemp("compile"))), num_kv_blocks=64) as llm:
        yield llm


def constrained(spec: StructuredOutput) -> SamplingParams:
    return msgspec.structs.replace(STRUCTURED, structured_output=spec)


def engine_request(llm: LLM, request_id: str, prompt: str, params: SamplingParams):
    tokens = llm.prompt_processor.tokenizer.encode(prompt).ids
    return EngineRequest(request_id=request_id, prompt_token_ids=tokens, sampling=params)


def run_until(engine, done) -> dict[str, list]:
    outputs: dict[str, list] = {}
    for _ in range(500):
        for output in engine.step().outputs:
            outputs.setdefault(output.request_id, []).append(output)
        if done(outputs):
            return outputs
    raise AssertionError(f"not done after 500 steps: {outputs}")


def finished(outputs, request_id) -> bool:
    return any(o.finish_reason is not None for o in outputs.get(request_id, []))


def tokens(outputs, request_id) -> list[int]:
    return [t for o in outputs[request_id] for t in o.new_token_ids]


def test_requests_decode_while_a_grammar_compiles(llm, monkeypatch):
    """Compiling is held up until the plain request beside it has finished: with the
    compile on the engine loop (as before) that request could not finish first."""
    engine = llm.engine
    fresh = StructuredOutput(json=SPEC.json.replace('"a"', '"b"'))  # not in the cache yet
    compiler = engine._grammar_compiler()
    release, compiling = threading.Event(), threading.Event()
    compile_for_real = compiler.matcher

    def slow_matcher(spec):
        compiling.set()
        assert release.wait(10)
        return compile_for_real(spec)

    monkeypatch.setattr(compiler, "matcher", slow_matcher)
    engine.add_request(engine_request(llm, "slow", "{ the sea", constrained(fresh)))
    engine.add_request(engine_request(llm, "plain", "a b c", PLAIN))
    assert compiling.wait(10) and engine.grammars.num_compiling == 1
    outputs = run_until(engine, lambda o: finished(o, "plain"))
    assert len(tokens(outputs, "plain")) == 6 and "slow" not in outputs
    assert engine.grammars.num_compiling == 1
    release.set()
    outputs = run_until(engine, lambda o: finished(o, "slow"))
    assert outputs["slow"][-1].finish_reason == FinishReason.STOP
    monkeypatch.undo()
    again = llm.generate(["{ the sea"], constrained(fresh))[0]
    assert tokens(outputs, "slow") == again.token_ids  # compiled, then copied: the same


def test_a_repeated_spec_is_copied_from_the_cache_without_waiting(llm):
    engine = llm.engine
    first = llm.generate(["{ one"], STRUCTURED)[0]
    engine.add_request(engine_request(llm, "cached", "{ one", STRUCTURED))
    assert engine.grammars.num_compiling == 0  # admitted straight to the scheduler
    assert engine.scheduler.has_unfinished_requests()
    outputs = run_until(engine, lambda o: finished(o, "cached"))
    assert tokens(outputs, "cached") == first.token_ids


def test_an_abort_while_compiling_ends_only_that_request(llm, monkeypatch):
    engine = llm.engine
    compiler = engine._grammar_compiler()
    release = threading.Event()
    compile_for_real = compiler.matcher
    monkeypatch.setattr(
        compiler, "matcher", lambda spec: release.wait(10) and compile_for_real(spec)
    )
    spec = StructuredOutput(regex="[0-9]+ apples")  # not cached
    engine.add_request(engine_request(llm, "aborted", "x", constrained(spec)))
    engine.add_request(engine_request(llm, "kept", "x", constrained(spec)))
    engine.abort_requests(["aborted"])
    outputs = run_until(engine, lambda o: finished(o, "aborted"))
    assert outputs["aborted"][-1].finish_reason == FinishReason.ABORT
    assert engine.grammars.num_compiling == 1
    release.set()
    outputs = run_until(engine, lambda o: finished(o, "kept"))
    assert outputs["kept"][-1].error is None and tokens(outputs, "kept")
    assert "aborted" not in outputs and not engine.has_unfinished_requests()


def test_an_unusable_grammar_fails_its_request_off_the_loop(llm):
    """The server checks grammars first; the offline LLM sends them straight here."""
    bad = SamplingParams(max_tokens=4, structured_output=StructuredOutput(regex="a(b"))
    failed, answered = llm.generate(["x", "y"], [bad, PLAIN])
    assert failed.finish_reason == "error" and failed.error.param == "structured_output"
    assert answered.error is None and len(answered.token_ids) == 6
    assert llm.engine.grammars.num_compiling == 0


def test_the_compile_worker_takes_the_smallest_spec_first():
    """Four queued 5000-property schemas held a one-property schema 8.8-12 s: it compiled
    after all of them. Now it waits for at most the compile under way."""
    from engine.grammar_admission import SmallestFirstWorker

    worker = SmallestFirstWorker("test-compile")
    started, release, ran = threading.Event(), threading.Event(), []

    def hold() -> None:
        started.set()
        release.wait(10)

    try:
        busy = worker.submit(100, hold)
        assert started.wait(10)  # under way: the others queue behind it
        futures = [worker.submit(size, ran.append, size) for size in (50, 1, 30, 1)]
        cancelled = worker.submit(2, ran.append, "never")
        assert cancelled.cancel()
        release.set()
        for future in (busy, *futures):
            future.result(timeout=10)
        assert ran == [1, 1, 30, 50] and cancelled.cancelled()
        failing = worker.submit(1, int, "not a number")
        with pytest.raises(ValueError):
            failing.result(timeout=10)
    finally:
        release.set()
        worker.close()
