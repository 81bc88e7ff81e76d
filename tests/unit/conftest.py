"""Fixtures several unit modules share: the HTTP app over the scripted fake engine
(tests/unit/fake_engine.py), and a local feature origin with a fetcher that may reach it
(tests/unit/test_feature_fetcher_http.py). A module's own fixture of the same name wins."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from engine.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def app(model_dir):
    from tests.unit.fake_engine import client_for

    client, engine = client_for(model_dir)
    with client:
        yield client, engine


@pytest.fixture
def origin():
    from tests.unit.test_feature_fetcher_http import serving

    with serving() as server:
        yield server


@pytest.fixture
def fetcher():
    from tests.unit.test_feature_fetcher_http import private_fetcher

    with private_fetcher() as client:
        yield client
