"""URL and body guards at their edges: length caps one byte over, blocked address ranges,
prefix checks, the fetch session's settings, multi-picture JPEGs (mutation testing found each
untested)."""

from __future__ import annotations

import asyncio
import ipaddress

import pytest

from engine.url_safety import (
    BodyTooLargeError,
    UnsafeUrlError,
    UrlPolicy,
    is_blocked_address,
    read_capped,
)


async def _chunks(*parts):
    for part in parts:
        yield part


def test_a_declared_length_one_over_the_cap_is_refused_before_reading():
    # and a body one byte over
    with pytest.raises(BodyTooLargeError):
        asyncio.run(read_capped(_chunks(), 10, declared_length=11))
    with pytest.raises(BodyTooLargeError):
        asyncio.run(read_capped(_chunks(b"x" * 6, b"x" * 5), 10))
    assert asyncio.run(read_capped(_chunks(b"x" * 10), 10, declared_length=10)) == b"x" * 10


@pytest.mark.parametrize("address", ["100.64.0.1", "100.127.255.254", "fe80::1%1", "2002:7f00:1::"])
def test_cgnat_scoped_and_6to4_loopback_addresses_are_blocked(address):
    # a scope id, CGNAT, 6to4 embedding 127.0.0.1
    host, _, scope = address.partition("%")
    parsed = ipaddress.ip_address(host if not scope else address)
    assert is_blocked_address(parsed)


def test_a_file_url_with_a_query_or_fragment_is_refused(tmp_path):
    (tmp_path / "a.png").write_bytes(b"x")
    policy = UrlPolicy(allowed_local_path=str(tmp_path))
    assert policy.resolve_local_path(f"file://{tmp_path}/a.png")
    for url in (f"file://{tmp_path}/a.png?x=1", f"file://{tmp_path}/a.png#f"):
        with pytest.raises(UnsafeUrlError):
            policy.resolve_local_path(url)


def test_an_encoded_backslash_under_an_allowed_prefix_is_refused():
    # a store that decodes %5C could climb out of the allowed folder
    from engine.url_safety import is_under_prefixes

    prefixes = ("https://store.example/allowed/",)
    assert is_under_prefixes("https://store.example/allowed/a.bin", prefixes)
    assert not is_under_prefixes("https://store.example/allowed/..%5Csecret", prefixes)
    assert not is_under_prefixes("https://store.example/allowed/..%2Fsecret", prefixes)


def test_the_guarded_session_keeps_no_cookies_and_ignores_env_proxies():
    import aiohttp

    from engine.url_safety import guarded_session

    async def scenario():
        session = guarded_session(UrlPolicy(), timeout_s=1.0)
        try:
            return isinstance(session.cookie_jar, aiohttp.DummyCookieJar), session.trust_env
        finally:
            await session.close()

    assert asyncio.run(scenario()) == (True, False)


def test_a_data_url_whose_header_does_not_end_in_base64_is_refused():
    from engine.multimodal.media import DataUrlError, parse_data_url

    assert parse_data_url("data:image/png;base64,AAAA", 100) == b"\0\0\0"
    with pytest.raises(DataUrlError, match="only base64"):
        parse_data_url("data:image/png;base64;x=y,AAAA", 100)


def test_an_oversized_data_url_is_refused_before_any_decoding(monkeypatch):
    # the cap is checked on the base64 text (with slack for MIME line breaks)
    from engine.multimodal import media

    calls = []
    monkeypatch.setattr(media, "decode_base64", lambda text: calls.append(text) or b"")
    payload = "A" * (4 * ((300 + 2) // 3) * 66 // 64 + 65)
    with pytest.raises(media.DataUrlError, match="over 300 bytes"):
        media.parse_data_url("data:image/png;base64," + payload, 300)
    assert calls == []


def test_a_multi_picture_jpeg_is_a_jpeg():
    # camera photos with an MPO extension open as format "MPO"
    import io

    from PIL import Image

    from engine.multimodal.media import decode_image

    buf = io.BytesIO()
    first, second = Image.new("RGB", (32, 24), (200, 0, 0)), Image.new("RGB", (32, 24))
    first.save(buf, "MPO", save_all=True, append_images=[second])
    assert Image.open(io.BytesIO(buf.getvalue())).format == "MPO"
    assert decode_image(buf.getvalue()).size == (32, 24)


@pytest.mark.parametrize("width", [64, 76])
@pytest.mark.parametrize("line_end", ["\n", "\r\n"])
def test_base64_broken_into_mime_lines_is_read_up_to_the_cap(line_end, width):
    """76-character lines (Python's encodebytes, coreutils' base64, Java's MIME encoder)
    or 64 (PEM) add up to 3.1%: a file just under the cap was refused as over it (fuzz69,
    fuzz74)."""
    import base64
    import os

    from engine.multimodal.media import DataUrlError, parse_data_url

    for size, fits in ((100_000, True), (100_001, False)):
        data = os.urandom(size)
        text = base64.b64encode(data).decode()
        lines = line_end.join(text[i : i + width] for i in range(0, len(text), width))
        if fits:
            assert parse_data_url("data:image/png;base64," + lines, 100_000) == data
        else:
            with pytest.raises(DataUrlError, match="over 100000 bytes"):
                parse_data_url("data:image/png;base64," + lines, 100_000)
