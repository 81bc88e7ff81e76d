"""Which answers name a version of a feature file that lets a later request skip its
download: a strong ETag, or a Last-Modified at least a second older than the answer's Date
(RFC 9110 8.8.2.2); anything else is downloaded again (fuzz61 #1)."""

from __future__ import annotations

import pytest
from safetensors.torch import load

from bench.local_inputs import features
from engine.feature_fetcher import FeatureFetcher
from engine.feature_jobs import FetchConfig
from engine.feature_store import http_version
from tests.unit.test_feature_fetcher_http import fetch

NOW = "Sat, 28 Nov 2026 05:30:00 GMT"
SECOND_BEFORE = "Sat, 28 Nov 2026 05:29:59 GMT"


def _rows_of(data: bytes):
    return load(data)["embeds"]


def test_a_file_rewritten_within_its_last_modified_second_is_downloaded_again(origin, fetcher):
    """`python -m http.server` sends Last-Modified and no ETag: a file rewritten in the
    same second kept it, and the old file's rows were reused (a silent wrong answer)."""
    origin.date = NOW
    first, second = features(1), features(2)
    origin.answers["/f"] = [(200, {"Last-Modified": NOW}, first)]
    url = f"{origin.base}/f"
    assert fetch(fetcher, [url]).features[0].embeds is not None
    origin.answers["/f"] = [(200, {"Last-Modified": NOW}, second)]
    again = fetch(fetcher, [url]).features[0]
    assert again.embeds is not None and again.embeds.equal(_rows_of(second))


def test_a_weak_etag_is_no_version(origin, fetcher):
    first, second = features(3), features(4)
    origin.answers["/w"] = [(200, {"ETag": 'W/"same"'}, first)]
    url = f"{origin.base}/w"
    assert fetch(fetcher, [url]).features[0].embeds is not None
    origin.answers["/w"] = [(200, {"ETag": 'W/"same"'}, second)]
    again = fetch(fetcher, [url]).features[0]
    assert again.embeds is not None and again.embeds.equal(_rows_of(second))


def test_a_last_modified_a_second_older_than_the_date_is_a_version(origin, fetcher):
    origin.date = NOW
    origin.answers["/old"] = [(200, {"Last-Modified": SECOND_BEFORE}, features(5))]
    url = f"{origin.base}/old"
    downloaded = fetch(fetcher, [url]).features[0]
    again = fetch(fetcher, [url]).features[0]
    assert again.embeds is None and again.content_hash == downloaded.content_hash
    assert [method for method, _, _ in origin.log] == ["GET", "HEAD"]


@pytest.mark.parametrize(
    ("headers", "version"),
    [
        ({"etag": '"abc"', "date": NOW}, '"abc"'),
        ({"etag": 'W/"abc"', "date": NOW}, None),
        ({"last-modified": NOW, "date": NOW}, None),
        ({"last-modified": SECOND_BEFORE, "date": NOW}, f"last-modified {SECOND_BEFORE}"),
        ({"last-modified": SECOND_BEFORE}, None),  # no Date: no telling
        ({"last-modified": NOW, "date": SECOND_BEFORE}, None),  # the clocks disagree
        ({"last-modified": "yesterday", "date": NOW}, None),
        ({"etag": 'W/"abc"', "last-modified": "Sat, 28 Nov 2026 05:20:00 GMT", "date": NOW},
         "last-modified Sat, 28 Nov 2026 05:20:00 GMT"),
        ({}, None),
    ],
)  # fmt: skip
def test_only_strong_validators_are_versions(headers, version):
    assert http_version(headers) == version


def test_an_s3_object_is_checked_by_its_etag_and_a_rewrite_is_downloaded(monkeypatch):
    """Against moto in server mode: an unchanged object is a HEAD, a rewritten one (same
    size, so the same Content-Length) downloaded again."""
    moto_server = pytest.importorskip("moto.server")
    boto3 = pytest.importorskip("boto3")
    for name, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                        "AWS_DEFAULT_REGION": "us-east-1"}.items():  # fmt: skip
        monkeypatch.setenv(name, value)
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{server.get_host_and_port()[1]}"
    s3_fetcher = FeatureFetcher(FetchConfig(s3_endpoint_url=endpoint, backoff_s=0.01))
    try:
        s3 = boto3.client("s3", endpoint_url=endpoint)
        s3.create_bucket(Bucket="feat")
        first, second = features(6), features(7)
        assert len(first) == len(second)
        s3.put_object(Bucket="feat", Key="x", Body=first)
        downloaded = fetch(s3_fetcher, ["s3://feat/x"]).features[0]
        assert downloaded.embeds is not None
        assert fetch(s3_fetcher, ["s3://feat/x"]).features[0].embeds is None
        s3.put_object(Bucket="feat", Key="x", Body=second)
        again = fetch(s3_fetcher, ["s3://feat/x"]).features[0]
        assert again.embeds is not None and again.embeds.equal(_rows_of(second))
    finally:
        s3_fetcher.close()
        server.stop()
