"""Bearer-token check for the API routes (`settings.api_key`, env TESSERA_API_KEY).

Checked on the routed path (`request.scope["path"]`), never on a URL rebuilt from the Host
header. `/health`, `/metrics` and `/version` stay open so probes and scrapers need no key;
`/openapi.json` needs it, like the routes it describes.

The check runs in the API router's route class (server/json_body.py's `BoundedJsonRoute`),
before the body is read: a route added outside that router is not protected by it.
`tests/unit/test_app_settings.py::test_every_protected_route_checks_the_api_key` sends
every operation of the OpenAPI document under a protected prefix without the key and wants
a 401, so such a route fails the tests.
"""

from __future__ import annotations

import hmac

from fastapi import Request

from engine.errors import TesseraError

PROTECTED_PREFIXES = ("/v1/", "/tokenize", "/detokenize", "/openapi.json")


class Unauthorized(TesseraError):
    status = 401
    type = "invalid_request_error"
    code = "invalid_api_key"


def is_protected(path: str) -> bool:
    return path == "/v1" or any(path.startswith(prefix) for prefix in PROTECTED_PREFIXES)


def check_api_key(request: Request, api_key: str | None) -> None:
    """Raise Unauthorized unless the request carries `Authorization: Bearer <api_key>`."""
    if not api_key or not is_protected(request.scope.get("path", "")):
        return
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(
        token.strip().encode(), api_key.encode()
    ):
        raise Unauthorized("invalid or missing API key")
