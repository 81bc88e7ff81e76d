"""How the feature fetcher (engine/feature_fetcher.py) reads a store's answers.

Failures fall into four kinds:

* the client's: the file is missing, denied to us, malformed. A FeatureError, a 400, not
  retried;
* the store's, for now: a timeout, a 5xx, a throttle (429, SlowDown), a dropped
  connection. `Transient`: retried, then a 502 (FeatureError `server_error` / `network`);
* the server's own set-up: the store refused the server's credentials, or it has none
  (502 `feature_store_auth`), or the bucket is in another region than the server signs
  for (a 301, 502 `feature_store_region`). At once: retrying cannot help. It is never the client's
  400: alerts on 5xx must see it, and clients retry elsewhere;
* a URL the server will not fetch (unsafe, bad format): a 400.

Versions: an answer's validator lets a later request skip downloading an unchanged file.
Only a strong validator qualifies (RFC 9110 8.8.1): an ETag without `W/`, or a
Last-Modified at least one second older than the answer's Date (8.8.2.2). A file
rewritten within the second of its Last-Modified keeps that value, so a fresher one is
no version and the file is downloaded again.
"""

from __future__ import annotations

import email.utils
from datetime import UTC, datetime

from engine.feature_validation import FeatureError
from engine.multimodal.media import DataUrlError, parse_data_url

_TRANSIENT_S3_CODES = {
    "SlowDown",
    "Throttling",
    "ThrottlingException",
    "TooManyRequests",
    "TooManyRequestsException",
    "RequestLimitExceeded",
    "RequestThrottled",
    "RequestTimeout",
    "InternalError",
    "ServiceUnavailable",
    "429",
    "500",
    "502",
    "503",
    "504",
}
_NOT_FOUND_CODES = {"NoSuchKey", "NoSuchBucket", "404", "NotFound"}
_DENIED_CODES = {"AccessDenied", "AllAccessDisabled", "403", "401"}
# The bucket lives in another region than the server's S3 settings say. botocore's own
# redirect only helps on AWS endpoints; with --feature-s3-endpoint-url it asks the same
# endpoint again and gets the 301 back.
_REGION_CODES = {"PermanentRedirect", "AuthorizationHeaderMalformed", "301"}
# The store refused the credentials the SERVER signs with: the operator's to fix.
_CREDENTIAL_CODES = {
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "ExpiredToken",
    "ExpiredTokenException",
    "TokenRefreshRequired",
    "InvalidToken",
    "InvalidClientTokenId",
    "InvalidSecurity",
    "RequestTimeTooSkewed",
    "AuthorizationHeaderMalformed",
    "MissingSecurityHeader",
    "AccountProblem",
    "NotSignedUp",
}


class Transient(Exception):
    """A failure worth another try; after the last one, a FeatureError of `reason`."""

    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason = reason
        self.detail = detail


def display_url(url: str) -> str:
    """The URL as error messages show it: data: URLs and long URLs shortened."""
    if url.startswith("data:"):
        return "data: URL"
    return url if len(url) <= 200 else url[:200] + "..."


def failure(url: str, cause: str, reason: str) -> FeatureError:
    """The error a job ends with: `cause` for `url`."""
    return FeatureError(f"feature {display_url(url)}: {cause}", reason=reason)


def too_large(max_bytes: int) -> FeatureError:
    return FeatureError(f"too large (over {max_bytes} bytes)", reason="too_large")


def check_http_status(status: int) -> None:
    if status < 400:
        return
    if status == 404 or status == 410:
        raise FeatureError("not found (HTTP 404)", reason="not_found")
    if status in (401, 403):
        raise FeatureError(f"access denied (HTTP {status})", reason="access_denied")
    if status == 429 or status >= 500:
        raise Transient("server_error", f"the server answered HTTP {status}")
    raise FeatureError(f"the server answered HTTP {status}", reason="http_error")


def http_version(headers) -> str | None:
    """The strong validator of an answer's (case-insensitive, or lower-case) headers;
    None when it has none, so that the file is downloaded again."""
    etag = headers.get("etag")
    if etag and not etag.startswith("W/"):
        return etag
    modified = headers.get("last-modified")
    modified_at, date = _http_date(modified), _http_date(headers.get("date"))
    if modified_at is None or date is None or (date - modified_at).total_seconds() < 1:
        return None
    return f"last-modified {modified}"


def s3_version(response: dict) -> str | None:
    """`http_version` of a botocore GetObject / HeadObject answer."""
    headers = response.get("ResponseMetadata", {}).get("HTTPHeaders")
    return http_version(headers or {"etag": response.get("ETag")})


def _http_date(value: str | None) -> datetime | None:
    if not value:
        return None
    try:
        parsed = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError):
        return None
    return parsed if parsed.tzinfo is not None else parsed.replace(tzinfo=UTC)


def split_s3(url: str) -> tuple[str, str]:
    bucket, _, key = url.removeprefix("s3://").partition("/")
    if not bucket or not key:
        raise FeatureError("an s3:// URL needs a bucket and a key", reason="bad_format")
    return bucket, key


def raise_s3(exc: Exception):
    """Raises what a botocore failure means (FeatureError or Transient)."""
    # imported with aioboto3, as the client is
    from botocore.exceptions import (
        NoCredentialsError,
        ParamValidationError,
        PartialCredentialsError,
    )

    if isinstance(exc, ParamValidationError):  # an invalid bucket name or key: not retried
        raise FeatureError(f"not a valid S3 location ({exc})", reason="bad_format") from None
    if isinstance(exc, (NoCredentialsError, PartialCredentialsError)):
        raise FeatureError("the server has no S3 credentials", reason="store_auth") from None
    response = getattr(exc, "response", None)
    if isinstance(response, dict):
        code = str(response.get("Error", {}).get("Code", ""))
        status = response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0
        if code in _NOT_FOUND_CODES or status == 404:
            raise FeatureError("not found", reason="not_found") from None
        if code in _REGION_CODES or status == 301:
            raise _wrong_region(response) from None
        if code in _CREDENTIAL_CODES:
            raise FeatureError(
                f"the store refused the server's credentials ({code})", reason="store_auth"
            ) from None
        if code in _DENIED_CODES or status in (401, 403):
            raise FeatureError("access denied", reason="access_denied") from None
        if code in _TRANSIENT_S3_CODES or status == 429 or status >= 500:
            raise Transient("server_error", f"the store answered {code or status}") from None
        raise FeatureError(f"the store refused the request ({code})", reason="s3_error") from None
    raise Transient("network", f"connection failed ({type(exc).__name__})") from None


def _wrong_region(response: dict) -> FeatureError:
    error = response.get("Error", {})
    headers = response.get("ResponseMetadata", {}).get("HTTPHeaders") or {}
    region = headers.get("x-amz-bucket-region") or error.get("Region")
    where = f"in region {region}" if region else f"at {error['Endpoint']}" if error.get(
        "Endpoint") else "elsewhere"  # fmt: skip
    return FeatureError(
        f"the bucket is in another region than the server's S3 settings ({where}; "
        f"{error.get('Code') or 301}): set AWS_DEFAULT_REGION or --s3-endpoint-url",
        reason="store_region",
    )


def decode_data_url(url: str, max_bytes: int) -> bytes:
    try:
        return parse_data_url(url, max_bytes)
    except DataUrlError as exc:
        if exc.too_large:
            raise too_large(max_bytes) from None
        raise FeatureError(str(exc), reason="bad_format") from None
