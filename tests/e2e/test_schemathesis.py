"""Property-based API fuzzing with schemathesis: the OpenAPI document is fetched from the
running server's GET /openapi.json (over HTTP, as any client would), and cases generated
from it for POST /v1/chat/completions, /v1/completions and /v1/responses are sent to that server:
none may get a 5xx. Bounded: MAX_EXAMPLES per route and a small --max-model-len (128; a
large max_tokens is refused with 400)."""

from __future__ import annotations

import httpx
import pytest

from tests.e2e.conftest import MODEL_NAME, run_server

schemathesis = pytest.importorskip("schemathesis")
hypothesis = pytest.importorskip("hypothesis")

from schemathesis.checks import not_a_server_error  # noqa: E402

MAX_EXAMPLES = 40


@pytest.fixture(scope="module")
def fuzz_server(model_dir, tmp_path_factory):
    log_path = tmp_path_factory.mktemp("logs") / "schemathesis_server.log"
    with run_server(model_dir, log_path, "--max-model-len", "128") as handle:
        yield handle


@pytest.fixture(scope="module")
def api_schema(fuzz_server):
    return schemathesis.openapi.from_url(fuzz_server.base_url + "/openapi.json", timeout=30)


def test_openapi_json_lists_the_generation_routes(fuzz_server):
    response = httpx.get(fuzz_server.base_url + "/openapi.json", timeout=30)
    assert response.status_code == 200
    assert response.headers["content-type"] == "application/json"
    paths = response.json()["paths"]
    for route in ("/v1/chat/completions", "/v1/completions", "/v1/responses"):
        assert "post" in paths[route]
    assert "/openapi.json" not in paths
    for hidden in ("/docs", "/redoc"):
        assert httpx.get(fuzz_server.base_url + hidden, timeout=30).status_code == 404


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/v1/responses"])
def test_no_server_errors(api_schema, fuzz_server, path):
    operation = api_schema[path]["POST"]

    @hypothesis.given(case=operation.as_strategy())
    @hypothesis.settings(
        max_examples=MAX_EXAMPLES,
        deadline=None,
        suppress_health_check=list(hypothesis.HealthCheck),
        derandomize=True,
        database=None,
    )
    def check(case) -> None:
        if isinstance(case.body, dict):  # a random model name is just a 404; reach the engine
            case.body["model"] = MODEL_NAME
        case.call_and_validate(
            base_url=fuzz_server.base_url, checks=[not_a_server_error], timeout=30
        )

    check()


def test_server_still_serves_after_fuzzing(fuzz_server):
    body = {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": 4,
        "temperature": 0,
    }
    response = httpx.post(fuzz_server.base_url + "/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
