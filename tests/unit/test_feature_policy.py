"""Where feature URLs may come from (`--allowed-feature-url-prefixes`): a URL is held to the
prefixes as it will be fetched, so dot segments cannot climb out of an allowed folder."""

from __future__ import annotations

import dataclasses

import pytest

from engine.errors import InvalidRequest
from engine.protocol import Modality
from server.chat import FeaturePolicy, MediaPart

POLICY = FeaturePolicy(True, None, ("http://store.test/allowed/", "s3://feat/allowed/"), 2)


def check(url: str) -> None:
    POLICY.check(MediaPart("messages[0].content[0]", Modality.IMAGE, url, None, (1, 4, 4), True))


@pytest.mark.parametrize("url", [
    "http://store.test/allowed/x.safetensors", "http://STORE.TEST/allowed/x.safetensors",
    "http://store.test:80/allowed/./x.safetensors", "s3://feat/allowed/x.safetensors",
    "http://store.test/allowed/x?X-Amz-Credential=AK%2F2026%2Fs3&tag=%5C",  # a query's own
])  # fmt: skip
def test_urls_under_an_allowed_prefix_pass(url):
    check(url)


@pytest.mark.parametrize("url", [
    "http://store.test/allowed/../secret/x", "http://store.test/allowed/%2e%2e/secret/x",
    "http://store.test/allowed/%2E%2E/secret/x", "http://store.test/allowed/..%2Fsecret",
    "http://store.test/allowed/..%5Csecret", "http://store.test/allowedx/y",
    "s3://feat/other/x", "data:application/octet-stream;base64,AAAA",
])  # fmt: skip
def test_urls_that_leave_the_allowed_prefixes_are_refused(url):
    """The first four passed: the check read the string as sent, and the fetch asked the
    store for /secret/x (aiohttp resolves dot segments, percent-encoded ones too)."""
    with pytest.raises(InvalidRequest) as refused:
        check(url)
    assert refused.value.param == "messages[0].content[0].url"


@pytest.mark.parametrize("url", [
    "http://store.test/allowed/..%2Fsecret", "http://store.test/allowed/..%5csecret",
    "http://store.test/allowed/%2e%2e/secret/x",
])  # fmt: skip
def test_a_redirect_hop_is_held_to_the_prefixes_as_the_first_url_is(url):
    """The engine's fetcher checks every hop with `UrlPolicy.check_url`, which let an
    encoded slash through that the first URL's check refuses."""
    from engine.url_safety import UnsafeUrlError, UrlPolicy

    policy = UrlPolicy(allow_private=True, allowed_prefixes=("http://store.test/allowed/",))
    policy.check_url("http://store.test/allowed/x.safetensors")
    with pytest.raises(UnsafeUrlError):
        policy.check_url(url)


def test_the_policy_is_read_once_per_setting(tmp_path):
    """A request with a feature part read the model's preprocessor_config.json on the
    event loop every time (the cache decorator had moved to another function)."""
    from types import SimpleNamespace

    engine = SimpleNamespace(model=str(tmp_path), allowed_feature_url_prefixes="http://a.test/")
    settings = SimpleNamespace(enable_feature_inputs=True, allowed_feature_buckets=None,
                               engine=engine, video_fps=2.0)  # fmt: skip
    assert FeaturePolicy.from_settings(settings) is FeaturePolicy.from_settings(settings)


def test_the_engine_fetcher_holds_every_hop_to_the_http_prefixes():
    from types import SimpleNamespace

    from engine.config import EngineConfig
    from engine.feature_admission import FeatureAdmission

    config = EngineConfig(model="unused",
                          allowed_feature_url_prefixes="HTTP://Store.test:80/a/, s3://feat/a/")  # fmt: skip
    admission = FeatureAdmission(config, SimpleNamespace(), scheduler=None)
    try:
        assert admission.fetcher.config.allowed_url_prefixes == ("http://store.test/a/",)
    finally:
        admission.close()


def test_the_engine_fetcher_takes_the_fetch_limits_of_its_settings():
    """The connection pool and the remembered versions were constants (64, 16384)."""
    from types import SimpleNamespace

    from engine.config import EngineConfig
    from engine.feature_admission import FeatureAdmission

    config = EngineConfig(model="unused", feature_fetch_max_connections=5,
                          feature_known_versions=7, feature_fetch_parallel=3)  # fmt: skip
    admission = FeatureAdmission(config, SimpleNamespace(), scheduler=None)
    try:
        fetched = admission.fetcher.config
        assert (fetched.max_connections, fetched.max_known_versions, fetched.parallel) == (5, 7, 3)
    finally:
        admission.close()
    with pytest.raises(ValueError, match="feature_fetch_max_connections"):
        EngineConfig(model="unused", feature_fetch_max_connections=0)


@pytest.mark.parametrize("bucket", [
    "arn:aws:s3:us-east-1:123456789012:accesspoint:myap",
    "arn:aws:s3-object-lambda:us-east-1:123456789012:accesspoint:fn", "has space", "",
])  # fmt: skip
def test_an_s3_url_names_a_bucket_never_an_arn(bucket):
    """With any bucket allowed (the default), an access-point ARN as the "bucket" was passed
    to botocore, which sent the server's signed request to a host the client named part of
    (fuzz61), or on AWS to another account's access point or an Object Lambda."""
    policy = FeaturePolicy(True, None, None, 2)
    part = MediaPart("messages[0].content[0]", Modality.IMAGE, f"s3://{bucket}/key", None,
                     (1, 4, 4), True)  # fmt: skip
    with pytest.raises(InvalidRequest, match="not an S3 bucket name") as refused:
        policy.check(part)
    assert refused.value.param == "messages[0].content[0].url"
    for legacy in ("feat.store-1", "Old_Bucket"):  # older us-east-1 names are buckets too
        policy.check(dataclasses.replace(part, url=f"s3://{legacy}/key"))
