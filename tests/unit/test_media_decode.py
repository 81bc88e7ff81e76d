"""decode_image / decode_data_url: every way client bytes can be bad, and every PIL mode."""

from __future__ import annotations

import base64
import io
import struct
import zlib

import numpy as np
import pytest
from PIL import Image, ImageOps, features

from engine.errors import MediaError
from engine.multimodal.media import (
    ALLOWED_IMAGE_FORMATS,
    allow_image_pixels,
    convert_rgb,
    decode_data_url,
    decode_image,
)


def _encode(image: Image.Image, fmt: str, **kwargs) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt, **kwargs)
    return buffer.getvalue()


def _random_rgb(width: int, height: int, seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def _png_header_only(width: int, height: int) -> bytes:
    """A PNG signature + IHDR claiming width x height, with no pixel data at all."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        crc = zlib.crc32(kind + body) & 0xFFFFFFFF
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", crc)

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8-bit RGB
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IEND", b"")


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "GIF", "BMP"])
def test_round_trip_allowed_formats(fmt):
    image = _random_rgb(37, 21)
    decoded = decode_image(_encode(image, fmt))
    assert decoded.mode == "RGB"
    assert decoded.size == (37, 21)
    if fmt in ("PNG", "BMP"):
        assert np.array_equal(np.asarray(decoded), np.asarray(image))


@pytest.mark.skipif(not features.check("webp"), reason="Pillow built without WEBP")
def test_webp_decodes():
    decoded = decode_image(_encode(_random_rgb(16, 16), "WEBP", lossless=True))
    assert decoded.mode == "RGB" and decoded.size == (16, 16)


def test_empty_bytes():
    with pytest.raises(MediaError, match="empty") as info:
        decode_image(b"", param="messages[0].content[1]")
    assert info.value.param == "messages[0].content[1]"


def test_text_file_is_not_an_image():
    with pytest.raises(MediaError, match="not a readable image") as info:
        decode_image(b"hello, this is plain text\n" * 10, param="messages[1].content[0]")
    assert info.value.param == "messages[1].content[0]"
    assert "Traceback" not in info.value.message


def test_format_not_allowed():
    assert "TIFF" not in ALLOWED_IMAGE_FORMATS
    with pytest.raises(MediaError):
        decode_image(_encode(_random_rgb(8, 8), "TIFF"))


def test_truncated_png():
    data = _encode(_random_rgb(64, 64), "PNG")
    with pytest.raises(MediaError, match="truncated or corrupt"):
        decode_image(data[: len(data) // 2])


def test_huge_png_header_rejected_without_decoding():
    # 50000 x 50000 x 3 bytes would be 7.5 GB; only the 45-byte header exists.
    with pytest.raises(MediaError, match="pixels") as info:
        decode_image(_png_header_only(50_000, 50_000), param="image")
    assert info.value.param == "image"


def test_max_pixels_checked_from_header_before_decoding():
    # No IDAT: decoding would fail as "corrupt", so a size message proves the header check.
    with pytest.raises(MediaError, match="the limit is 10000"):
        decode_image(_png_header_only(200, 200), max_pixels=10_000)
    decode_image(_encode(_random_rgb(100, 100), "PNG"), max_pixels=10_000)


def test_cmyk_jpeg():
    cmyk = Image.new("CMYK", (20, 10), (0, 255, 255, 0))  # pure red in CMYK
    decoded = decode_image(_encode(cmyk, "JPEG", quality=100))
    assert decoded.mode == "RGB" and decoded.size == (20, 10)
    red, green, blue = np.asarray(decoded).reshape(-1, 3).mean(axis=0)
    assert red > 200 and green < 50 and blue < 50


def test_sixteen_bit_png_scaled_not_clipped():
    values = np.array([[0, 256, 32768, 65535]], dtype=np.uint16)
    image = Image.fromarray(values)
    assert image.mode == "I;16"
    decoded = decode_image(_encode(image, "PNG"))
    assert decoded.mode == "RGB"
    assert np.asarray(decoded)[0, :, 0].tolist() == [0, 1, 128, 255]


@pytest.mark.parametrize("mode", ["I;16", "I;16B", "I"])
def test_sixteen_bit_levels_are_scaled_in_their_own_width(mode):
    """Each 16-bit level keeps its top 8 bits, in every layout Pillow opens them in, and
    the conversion holds a few bytes a pixel: it made three int64 copies (24 bytes a
    pixel; an 8000x8000 PNG of 135 KB took 1.2 GB, fuzz69)."""
    import tracemalloc

    from engine.multimodal.media import convert_rgb

    levels = np.random.default_rng(0).integers(0, 65536, (1000, 1000), dtype=np.uint16)
    if mode == "I":
        image = Image.fromarray(levels.astype(np.int32), mode="I")
    else:
        image = Image.frombytes(mode, (1000, 1000), levels.astype(
            ">u2" if mode == "I;16B" else "<u2").tobytes())  # fmt: skip
    tracemalloc.start()
    try:
        rgb = convert_rgb(image)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert np.array_equal(np.asarray(rgb)[:, :, 0], (levels >> 8).astype(np.uint8))
    if mode != "I":  # older Pillow's layout: int32, clipped
        assert peak < 6 * levels.size, peak


def test_animated_gif_gives_first_frame():
    frames = [Image.new("RGB", (12, 12), color) for color in ((255, 0, 0), (0, 0, 255))]
    data = _encode(frames[0], "GIF", save_all=True, append_images=frames[1:], duration=50)
    assert Image.open(io.BytesIO(data)).n_frames == 2
    decoded = decode_image(data)
    assert decoded.mode == "RGB"
    assert tuple(np.asarray(decoded)[5, 5]) == (255, 0, 0)


def test_one_by_one_image():
    decoded = decode_image(_encode(Image.new("RGB", (1, 1), (1, 2, 3)), "PNG"))
    assert decoded.size == (1, 1) and tuple(np.asarray(decoded)[0, 0]) == (1, 2, 3)


def test_one_bit_and_grayscale():
    one_bit = Image.new("1", (9, 4), 1)
    assert np.all(np.asarray(decode_image(_encode(one_bit, "PNG"))) == 255)
    gray = Image.new("L", (9, 4), 77)
    assert np.all(np.asarray(decode_image(_encode(gray, "PNG"))) == 77)


def test_rgba_composited_on_white():
    rgba = np.zeros((2, 2, 4), dtype=np.uint8)
    rgba[0, 0] = (10, 20, 30, 255)  # opaque
    rgba[0, 1] = (10, 20, 30, 0)  # fully transparent -> white
    rgba[1, 0] = (0, 0, 0, 128)  # half transparent black -> mid grey
    decoded = np.asarray(decode_image(_encode(Image.fromarray(rgba), "PNG")))
    assert tuple(decoded[0, 0]) == (10, 20, 30)
    assert tuple(decoded[0, 1]) == (255, 255, 255)
    assert 120 <= decoded[1, 0, 0] <= 135


def test_palette_with_transparency_composited_on_white():
    palette_image = Image.new("P", (4, 4), 0)
    palette_image.putpalette([0, 0, 0] * 256)
    palette_image.info["transparency"] = 0
    decoded = decode_image(_encode(palette_image, "PNG", transparency=0))
    assert np.all(np.asarray(decoded) == 255)


def test_convert_rgb_keeps_rgb_pixels():
    image = _random_rgb(5, 7)
    assert np.array_equal(np.asarray(convert_rgb(image)), np.asarray(image))


# ---------------------------------------------------------------------- data URLs


def test_data_url_round_trip():
    data = _encode(_random_rgb(8, 8), "PNG")
    url = "data:image/png;base64," + base64.b64encode(data).decode()
    assert decode_data_url(url, max_bytes=len(data)) == data


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("https://example.com/a.png", "data: URL"),
        ("data:image/png;base64", "no ','"),
        ("data:image/png,rawbytes", "base64"),
        ("data:image/png;base64,@@@notbase64@@@", "not valid base64"),
        ("data:image/png;base64,", "empty"),
    ],
)
def test_data_url_errors(url, message):
    with pytest.raises(MediaError, match=message) as info:
        decode_data_url(url, max_bytes=1000, param="messages[0].content[0].image_url")
    assert info.value.param == "messages[0].content[0].image_url"


def test_data_url_size_cap_checked_before_decoding():
    # Invalid base64 far past the cap: the size message (not a base64 error) proves the
    # cap is applied to the encoded length first.
    url = "data:image/png;base64," + "!" * 10_000
    with pytest.raises(MediaError, match="over 100 bytes"):
        decode_data_url(url, max_bytes=100)
    exact = base64.b64encode(b"x" * 100).decode()
    assert decode_data_url("data:image/png;base64," + exact, max_bytes=100) == b"x" * 100
    over = base64.b64encode(b"x" * 101).decode()
    with pytest.raises(MediaError, match="over 100 bytes"):
        decode_data_url("data:image/png;base64," + over, max_bytes=100)


# ------------------------------------------------ feature data URLs share the parser


@pytest.mark.parametrize(
    ("url", "reason", "message"),
    [
        ("data:application/octet-stream,raw", "bad_format", "base64"),
        ("data:application/octet-stream;base64,@@@", "bad_format", "not valid base64"),
        ("data:application/octet-stream;base64,", "bad_format", "empty"),
        ("data:application/octet-stream;base64," + "A" * 400, "too_large", "too large"),
    ],
)
def test_feature_data_url_errors_keep_their_reasons(url, reason, message):
    from engine.feature_store import decode_data_url
    from engine.feature_validation import FeatureError

    with pytest.raises(FeatureError, match=message) as info:
        decode_data_url(url, max_bytes=100)
    assert info.value.reason == reason


def test_feature_data_urls_take_what_image_data_urls_take():
    # One parser: a line-broken payload and an upper-case ";BASE64" header, accepted for
    # images, are accepted for features too (the feature path used to refuse both).
    from engine.feature_store import decode_data_url

    data = bytes(range(256)) * 3
    encoded = base64.encodebytes(data).decode()  # a line break every 76 characters
    assert "\n" in encoded
    assert decode_data_url("data:application/octet-stream;base64," + encoded, 1000) == data
    assert decode_data_url("data:x;BASE64," + base64.b64encode(data).decode(), 1000) == data


def test_the_max_pixels_setting_is_the_limit_above_pillows_own(monkeypatch):
    """Pillow's process-wide cap (89,478,485 pixels) hid every larger setting: a 9500 x 9500
    image was refused as over "89478485", a value nobody set; past twice that Pillow refuses
    at open. A server raises the cap to its setting (never lowers it)."""
    side = 9500
    buffer = io.BytesIO()
    Image.new("1", (side, side)).save(buffer, "PNG")  # 1 bit a pixel: small to make
    with pytest.raises(MediaError, match=f"the limit is {side * side - 1}$"):
        decode_image(buffer.getvalue(), max_pixels=side * side - 1)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", Image.MAX_IMAGE_PIXELS)  # restored after
    allow_image_pixels(500_000_000)
    assert Image.MAX_IMAGE_PIXELS == 500_000_000
    allow_image_pixels(1000)
    assert Image.MAX_IMAGE_PIXELS == 500_000_000
    header = _png_header_only(20_000, 20_000)  # 400 Mpx: over twice Pillow's own cap
    with pytest.raises(MediaError, match="the data is not a readable image|truncated"):
        decode_image(header, max_pixels=500_000_000)  # past the size checks: no pixels


@pytest.mark.parametrize("orientation", [3, 6, 8])
def test_exif_orientation_turns_the_picture_upright(orientation):
    """Phone cameras store photos sideways and say so in EXIF; transformers' load_image
    turns them (ImageOps.exif_transpose). The model saw them as stored."""
    stored = _random_rgb(64, 112)
    exif = Image.Exif()
    exif[0x0112] = orientation
    buffer = io.BytesIO()
    stored.save(buffer, "PNG", exif=exif.tobytes())
    expected = ImageOps.exif_transpose(Image.open(io.BytesIO(buffer.getvalue())))
    decoded = decode_image(buffer.getvalue())
    assert decoded.size == ((64, 112) if orientation == 3 else (112, 64))
    assert np.array_equal(np.asarray(decoded), np.asarray(expected.convert("RGB")))
    assert decode_image(_encode(stored, "PNG")).size == stored.size  # no EXIF: as stored
