"""The offline LLM under misuse (fuzz31): an interrupted call, mistyped sampling params,
malformed chat prompts and two threads at once must leave every other prompt, and the
next call, the greedy tokens transformers gives."""

from __future__ import annotations

import threading

import numpy as np
import pytest

pytest.importorskip("transformers")

from engine import LLM, SamplingParams  # noqa: E402
from engine.tiny_model import make_tiny_model  # noqa: E402
from tests.parity.test_generate import GREEDY, Reference, check, make_prompts  # noqa: E402


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return Reference(make_tiny_model(tmp_path_factory.mktemp("misuse"), seed=0, size="tiny"))


@pytest.fixture(scope="module")
def prompts():
    return make_prompts()


@pytest.fixture(scope="module")
def llm(reference):
    with LLM(str(reference.model_dir), num_kv_blocks=256) as llm:
        yield llm


def test_an_interrupted_call_leaves_the_next_one_its_answers(llm, reference, prompts):
    """A Ctrl-C inside a step (after the scheduler had moved on) left the call's requests in
    the engine with a token in flight: the next call's prompt failed with an internal error."""
    launch, calls = llm.engine.runner.launch, []

    def interrupted(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return launch(*args, **kwargs)

    llm.engine.runner.launch = interrupted
    try:
        with pytest.raises(KeyboardInterrupt):
            llm.generate([prompts[0], prompts[1]], GREEDY)
    finally:
        llm.engine.runner.launch = launch
    assert not llm.engine.scheduler.has_unfinished_requests()
    check(llm.generate([prompts[0]], GREEDY), reference, prompts, [0])


def test_mistyped_sampling_params_fail_their_own_prompt(llm, reference, prompts):
    """A msgspec Struct checks no types: these failed every prompt of their step with an
    "internal error while running the model", or raised from generate() and broke the
    next call; logprobs had no upper bound (the whole vocabulary for every token)."""
    bad = [
        (SamplingParams(max_tokens=4, stop_token_ids=("a",), min_tokens=2), "stop_token_ids"),
        (SamplingParams(max_tokens=4, stop_token_ids=5), "stop_token_ids"),
        (SamplingParams(max_tokens="5"), "max_tokens"),
        (SamplingParams(max_tokens=4, logit_bias={5: 1.0}), "logit_bias"),
        (SamplingParams(max_tokens=4, logprobs=2.5), "logprobs"),
        (SamplingParams(max_tokens=4, logprobs=10**6), "logprobs"),
        (SamplingParams(max_tokens=4, prompt_logprobs=21), "prompt_logprobs"),
        (SamplingParams(max_tokens=4, presence_penalty=2.5), "presence_penalty"),  # vLLM's [-2, 2]
        (SamplingParams(max_tokens=4, frequency_penalty=-3), "frequency_penalty"),
        ({"max_tokens": 4}, "sampling_params"),
    ]
    batch = [prompts[0]] * (len(bad) + 1)
    results = llm.generate(batch, [GREEDY, *(params for params, _ in bad)])
    check(results[:1], reference, prompts, [0])
    assert [r.error.param if r.error else None for r in results[1:]] == [p for _, p in bad]
    assert all(r.error.status == 400 for r in results[1:])
    check(llm.generate([prompts[1]], GREEDY), reference, prompts, [1])
    with pytest.raises(ValueError, match="one SamplingParams or one per prompt"):
        llm.generate([prompts[0], prompts[1]], [])  # ran both with the defaults
    with pytest.raises(TypeError, match="SamplingParams"):
        llm.generate([prompts[0]], {"max_tokens": 4})  # its key was taken for the params


def test_numpy_values_in_sampling_params_still_work(llm, reference, prompts):
    """The type check raised TypeError out of generate() on a numpy value (no prompt got a
    result); before it they generated as the Python values they hold."""
    numpy_greedy = SamplingParams(max_tokens=np.int64(GREEDY.max_tokens),
                                  temperature=np.float32(0.0), ignore_eos=True,
                                  logprobs=np.int64(1), seed=np.int64(7))  # fmt: skip
    check(llm.generate([prompts[0]], numpy_greedy), reference, prompts, [0])
    [result] = llm.generate([prompts[0]], SamplingParams(max_tokens=4, top_k=object()))
    assert result.error.param == "sampling_params"


def test_malformed_chat_prompts_fail_alone_and_leave_nothing_behind(llm, reference, prompts):
    """They raised out of generate() (ValueError, RuntimeError, IndexError), and the prompts
    added before them ran during the next call."""
    frames_2d = [np.zeros((28, 28), np.uint8)] * 4
    malformed = [
        {"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": "x"},
        {"messages": [{"role": "user", "content": [{"type": "video", "video": frames_2d}]}]},
        {"messages": [{"role": "user", "content": [{"type": "video", "video": [1, 2, 3]}]}]},
    ]
    results = llm.generate([prompts[0], *malformed, prompts[1]], GREEDY)
    check([results[0], results[-1]], reference, prompts, [0, 1])
    assert [r.error.param for r in results[1:-1]] == [
        "chat_template_kwargs", "messages[0].content[0]", "messages[0].content[0]",
    ]  # fmt: skip
    check(llm.generate([prompts[2]], GREEDY), reference, prompts, [2])
    assert sum(stats.generation_tokens_total for stats in llm.last_stats) == GREEDY.max_tokens


def test_malformed_tool_calls_fail_their_own_chat(llm, reference, prompts):
    """Converting their arguments raised AttributeError out of generate() for the whole
    batch (fuzz88); the template's refusal is the prompt's own error."""
    malformed = [
        {"messages": [{"role": "user", "content": "hi"},
                      {"role": "assistant", "content": None, "tool_calls": calls}]}
        for calls in ("abc", 5, [5], [{"function": "f"}])
    ]  # fmt: skip
    results = llm.generate([prompts[0], *malformed, prompts[1]], GREEDY)
    check([results[0], results[-1]], reference, prompts, [0, 1])
    assert all(r.error is not None for r in results[1:-1]), [r.error for r in results]


def test_a_lone_surrogate_fails_its_own_prompt(llm, reference, prompts):
    """The tokenizer's TypeError came out of generate() for the whole batch; the server
    answers such a body 400 (fuzz88)."""
    bad = ["a\ud800b", {"messages": [{"role": "user", "content": "\udfff"}]},
           {"messages": [{"role": "assistant", "content": None, "tool_calls": [
               {"id": "c", "type": "function", "function": {"name": "f", "arguments": {"x": "\ud800"}}}]}]}]  # fmt: skip
    results = llm.generate([prompts[0], *bad, prompts[1]], GREEDY)
    check([results[0], results[-1]], reference, prompts, [0, 1])
    assert [r.error.param for r in results[1:-1]] == [
        "prompt", "prompt.messages[0].content",
        "prompt.messages[0].tool_calls[0].function.arguments.x",
    ]  # fmt: skip


def test_bad_token_id_prompts_fail_alone(llm, reference, prompts):
    """A negative, huge or non-int id raised OverflowError or TypeError out of the
    tokenizer for the whole batch (fuzz87); the server answers such a prompt 400."""
    bad = [[-1], [2**70], [1.5, 2.0], [["a", "b"]], [True], [10**6]]
    results = llm.generate([prompts[0], *bad, prompts[1]], GREEDY)
    check([results[0], results[-1]], reference, prompts, [0, 1])
    assert [r.error.param if r.error else None for r in results[1:-1]] == ["prompt"] * len(bad)
    # numpy's integers are ids, as they were before the check (fuzz88)
    [as_numpy] = llm.generate([list(np.array(results[0].prompt_token_ids))], GREEDY)
    assert as_numpy.error is None and as_numpy.token_ids == results[0].token_ids


@pytest.mark.parametrize("n", [1, 2])
def test_a_seed_outside_int64_is_refused_whatever_n(llm, n):
    """With n 2 the choices' seeds were wrapped into int64 first: 2**64 drew as seed 0, where
    n 1 was refused, as the server refuses both (fuzz87)."""
    sampling = SamplingParams(max_tokens=2, temperature=1.0, seed=2**64, n=n)
    [result] = llm.generate(["hi"], sampling)
    assert result.error is not None and result.error.param == "seed", result


def test_two_threads_share_one_llm(llm, reference, prompts):
    """They corrupted each other's calls (a KeyError in one, partial tokens in the other)."""
    results = {}

    def run(index):
        results[index] = llm.generate([prompts[index]], GREEDY)

    threads = [threading.Thread(target=run, args=(i,)) for i in (0, 1, 2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    for index in (0, 1, 2):
        check(results[index], reference, prompts, [index])


def test_chat_is_generate_of_message_prompts(llm):
    """LLM.chat (vLLM's): one conversation or several, rendered as generate() renders
    {"messages": ...} prompts, with the same rendering keys."""
    first = [{"role": "user", "content": "Describe the floor."}]
    second = [{"role": "user", "content": "Count the tiles."},
              {"role": "assistant", "content": "There are"}]  # fmt: skip
    expected = llm.generate([{"messages": first},
                             {"messages": second, "continue_final_message": True}], GREEDY)  # fmt: skip
    [one] = llm.chat(first, GREEDY)
    assert one.prompt_token_ids == expected[0].prompt_token_ids
    assert one.token_ids == expected[0].token_ids
    [continued] = llm.chat([second], GREEDY, continue_final_message=True)
    assert continued.prompt_token_ids == expected[1].prompt_token_ids
    assert continued.token_ids == expected[1].token_ids
    # vLLM's `tools`: rendered into the prompt (fuzz109: a TypeError, though the README
    # says LLM.chat works as vLLM's), the same as a {"messages", "tools"} prompt
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
    [with_tools] = llm.chat(first, GREEDY, tools=tools)
    [as_prompt] = llm.generate([{"messages": first, "tools": tools}], GREEDY)
    assert "get_weather" in with_tools.prompt and "get_weather" not in one.prompt
    assert with_tools.prompt_token_ids == as_prompt.prompt_token_ids
    with pytest.raises(TypeError, match="tool_choice"):
        llm.chat(first, GREEDY, tool_choice="auto")
    [not_dicts] = llm.chat(first, GREEDY, tools=["x"])  # transformers refuses them (fuzz110)
    assert not_dicts.error.param == "tools"


def test_vllms_text_and_token_prompt_dicts_are_their_prompts(llm):
    """{"prompt": str} and {"prompt_token_ids": [...]} failed as an unknown prompt form,
    the first thing a script written for vLLM tries (fuzz111); multi_modal_data says where
    media go instead."""
    text, ids = llm.generate(["Hello there", [5, 6, 7]], GREEDY)
    as_text, as_ids, with_media, mixed = llm.generate(
        [{"prompt": "Hello there"}, {"prompt_token_ids": [5, 6, 7]},
         {"prompt": "Hello", "multi_modal_data": {"image": None}},
         {"prompt": "Hello", "prompt_token_ids": [5]}],
        GREEDY,
    )  # fmt: skip
    assert as_text.token_ids == text.token_ids and as_text.prompt == "Hello there"
    assert as_ids.prompt_token_ids == [5, 6, 7] and as_ids.token_ids == ids.token_ids
    assert with_media.error.param == "multi_modal_data"
    assert mixed.error.param == "prompts" and "prompt_token_ids" in mixed.error.message


def test_results_name_their_prompt_as_vllms_do(llm):
    """vLLM's `RequestOutput.prompt` and `finished`: the string given, a chat's rendering
    (its template's text, tokenised into the prompt's ids), None for token ids."""
    chat = [{"role": "user", "content": "Describe the floor."}]
    text, rendered, ids = llm.generate(["Hello there", {"messages": chat}, [5, 6, 7]], GREEDY)
    assert text.prompt == "Hello there" and ids.prompt is None
    assert "Describe the floor." in rendered.prompt
    assert llm.prompt_processor.encode(rendered.prompt) == rendered.prompt_token_ids
    assert text.finished and rendered.finished and ids.finished


def test_max_logprobs_bounds_what_a_request_may_ask(reference, prompts):
    """--max-logprobs / LLM(max_logprobs=...): 20 was a constant, not a setting."""
    with LLM(str(reference.model_dir), num_kv_blocks=64, max_logprobs=30) as llm:
        asks = [SamplingParams(max_tokens=2, logprobs=30, prompt_logprobs=30),
                SamplingParams(max_tokens=2, logprobs=31),
                SamplingParams(max_tokens=2, prompt_logprobs=31)]  # fmt: skip
        fits, too_many, too_many_prompt = llm.generate([prompts[0]] * 3, asks)
    assert fits.error is None
    assert all(len(entry.top) == 30 for entry in fits.logprobs + fits.prompt_logprobs)
    assert too_many.error.param == "logprobs" and "[0, 30]" in too_many.error.message
    assert too_many_prompt.error.param == "prompt_logprobs"


def test_vllms_max_tokens_none_cached_tokens_and_image_pil_parts(reference, prompts):
    """fuzz111: `SamplingParams(max_tokens=None)` (the rest of the context, in vLLM) failed
    its prompt; `RequestOutput.num_cached_tokens` and `image_pil` chat parts were missing."""
    from bench.local_inputs import picture

    whole = SamplingParams(max_tokens=None, temperature=0.0, ignore_eos=True)
    long_prompt = list(range(10, 50))  # 40 tokens: two whole 16-token blocks to cache
    with LLM(str(reference.model_dir), num_kv_blocks=64, max_model_len=48) as llm:
        short, full, over = llm.generate([[5, 6, 7], long_prompt[:8] * 6, [5] * 49], whole)
        assert len(short.token_ids) == 45 and short.finish_reason == "length"
        # No room left: refused, as vLLM's is (it sampled one token past the context)
        assert full.error.param == "max_tokens" and "48 tokens" in full.error.message
        assert over.error.param == "max_tokens" and "49 tokens" in over.error.message
        two = SamplingParams(max_tokens=2, temperature=0.0)
        first, again = (llm.generate([long_prompt], two)[0] for _ in range(2))
        assert first.num_cached_tokens == 0 and again.num_cached_tokens == 32
        image = picture(112, 84, 1)
        text = {"type": "text", "text": "What is this?"}
        as_image, as_pil = llm.chat([
            [{"role": "user", "content": [{"type": "image", "image": image}, text]}],
            [{"role": "user", "content": [{"type": "image_pil", "image_pil": image}, text]}],
        ], two)  # fmt: skip
        assert as_pil.error is None and as_pil.prompt_token_ids == as_image.prompt_token_ids
        assert as_pil.token_ids == as_image.token_ids
        [no_image] = llm.chat([{"role": "user", "content": [{"type": "image_pil"}]}], two)
        assert "'image_pil'" in no_image.error.message


def test_raise_on_error_raises_a_server_side_failure_with_its_own_status(llm, monkeypatch):
    """fuzz124: every result error was raised as an InvalidRequest (a 400), a grammar build
    that failed on the engine's side (a 500) too. Here the build cannot get its stack."""
    import engine.structured_output
    from engine import StructuredOutput
    from engine.errors import InvalidRequest, TesseraError

    monkeypatch.setattr(engine.structured_output, "GRAMMAR_STACK_BYTES", 1 << 62)
    regex = SamplingParams(max_tokens=2, structured_output=StructuredOutput(regex="[ab]+"))
    with pytest.raises(TesseraError) as raised:
        llm.generate(["Hello"], regex, raise_on_error=True)
    assert raised.value.status == 500 and not isinstance(raised.value, InvalidRequest)
    with pytest.raises(InvalidRequest):  # a 400 is still one
        llm.generate([[10**9]], GREEDY, raise_on_error=True)
