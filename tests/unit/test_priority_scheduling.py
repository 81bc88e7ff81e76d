"""--scheduling-policy priority on the engine: the most urgent request runs first, a more
urgent arrival takes the seat of a less urgent running one, and the preempted request
still answers what it would have alone; the default policy refuses a priority."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from engine.errors import InvalidRequest
from engine.protocol import EngineRequest
from engine.request_checks import RequestBuilder
from engine.tiny_model import make_tiny_model

PARAMS = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
SERVER_REFUSAL = "priority needs the server's --scheduling-policy priority"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("priority"))


def finish_order(engine, requests, arrivals=None) -> tuple[list[str], dict[str, list[int]]]:
    """Steps until every request is done; `arrivals` maps a step number to requests added
    before it. Returns the ids in finishing order and each one's tokens."""
    arrivals = arrivals or {}
    for request in requests:
        engine.add_request(request)
    order, tokens, step = [], {}, 0
    while engine.has_unfinished_requests() or arrivals:
        for request in arrivals.pop(step, []):
            engine.add_request(request)
        for output in engine.step().outputs:
            tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
            if output.finish_reason is not None:
                assert output.error is None, output.error
                order.append(output.request_id)
        step += 1
    return order, tokens


def request(llm, request_id: str, text: str, priority: int) -> EngineRequest:
    ids = llm.prompt_processor.tokenizer.encode(text).ids
    return EngineRequest(request_id=request_id, prompt_token_ids=ids, sampling=PARAMS,
                         priority=priority)  # fmt: skip


def test_the_most_urgent_runs_first_and_takes_a_running_seat(model_dir):
    with LLM(str(model_dir), max_num_seqs=1, scheduling_policy="priority") as llm:
        alone = {text: llm.generate([text], PARAMS)[0].token_ids for text in ("a b", "c d", "e f")}
        queued = [request(llm, "low", "a b", 5), request(llm, "high", "c d", -1),
                  request(llm, "mid", "e f", 0)]  # fmt: skip
        order, _ = finish_order(llm.engine, queued)
        assert order == ["high", "mid", "low"]
        # "low" runs alone; "urgent" arrives at step 3 and takes its seat at once.
        arrivals = {3: [request(llm, "urgent", "c d", 0)]}
        order, tokens = finish_order(llm.engine, [request(llm, "low", "a b", 5)], arrivals)
        assert order == ["urgent", "low"]
        assert tokens["low"] == alone["a b"] and tokens["urgent"] == alone["c d"]


def test_fcfs_keeps_arrival_order_and_refuses_a_priority(model_dir):
    with LLM(str(model_dir), max_num_seqs=1) as llm:
        order, _ = finish_order(llm.engine, [request(llm, "first", "a b", 0),
                                             request(llm, "second", "c d", 0)])  # fmt: skip
        assert order == ["first", "second"]
        [refused] = llm.generate(["a b"], PARAMS, priority=[1])
        assert refused.error is not None and refused.error.param == "priority"
        # The offline error names LLM's keyword, not the server's flag (fuzz87) ...
        assert refused.error.message == 'priority needs LLM(..., scheduling_policy="priority")'
        # ... while the engine the server runs still names the flag.
        builder = RequestBuilder(llm.engine.model_config, llm.engine.config.max_model_len,
                                 "fcfs", set(), max_logprobs=20)  # fmt: skip
        with pytest.raises(InvalidRequest) as refused_by_the_server:
            builder.build(request(llm, "server", "a b", 1))
        assert refused_by_the_server.value.message == SERVER_REFUSAL
