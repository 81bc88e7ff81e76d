"""A video's frame and time limits hold while its packets are listed, before any decoding:
a file of millions of one-byte packets held a decode thread for 18-200 s, with every other
video waiting behind it, whatever --max-video-decode-seconds said (fuzz67)."""

from __future__ import annotations

import fractions
import io

import pytest

pytest.importorskip("av")

from engine.errors import MediaError  # noqa: E402
from engine.multimodal import video_decode  # noqa: E402
from engine.multimodal.image_processor import ImageProcessorConfig  # noqa: E402
from engine.multimodal.video import VideoConfig  # noqa: E402
from engine.multimodal.video_decode import VideoLimits, decode_video  # noqa: E402

CONFIG = VideoConfig(ImageProcessorConfig(min_pixels=56 * 56, max_pixels=448 * 448), max_frames=8)


def one_byte_packets_mp4(num_packets: int) -> bytes:
    """An MP4 whose header declares `num_packets` one-byte MJPEG samples."""
    import av

    buffer = io.BytesIO()
    with av.open(buffer, "w", format="mp4") as out:
        stream = out.add_stream("mjpeg", rate=1000)
        stream.width, stream.height, stream.pix_fmt = 16, 16, "yuvj420p"
        for i in range(num_packets):
            packet = av.Packet(b"\xff")
            packet.stream, packet.pts, packet.dts = stream, i, i
            packet.time_base, packet.is_keyframe = fractions.Fraction(1, 1000), True
            out.mux(packet)
    return buffer.getvalue()


def _vint(n: int) -> bytes:
    size = next(size for size in range(1, 9) if n < (1 << (7 * size)) - 1)
    return ((1 << (7 * size)) | n).to_bytes(size, "big")


def _element(ident: str, payload: bytes) -> bytes:
    return bytes.fromhex(ident) + _vint(len(payload)) + payload


def _uint(ident: str, value: int) -> bytes:
    return _element(ident, value.to_bytes(max(1, (value.bit_length() + 7) // 8), "big"))


def laced_mkv(num_blocks: int) -> bytes:
    """A Matroska file that declares no frame count, whose blocks lace 256 one-byte frames
    each: a packet a byte (4000 blocks make a million)."""
    header = _element("1A45DFA3", _uint("4286", 1) + _uint("42F7", 1) + _uint("42F2", 4)
                      + _uint("42F3", 8) + _element("4282", b"matroska") + _uint("4287", 4)
                      + _uint("4285", 2))  # fmt: skip
    header += bytes.fromhex("1853806701FFFFFFFFFFFFFF")  # the segment, of unknown size
    header += _element("1549A966", _uint("2AD7B1", 1_000_000))
    track = (_uint("D7", 1) + _uint("73C5", 1) + _uint("83", 1) + _element("86", b"V_MJPEG")
             + _element("E0", _uint("B0", 16) + _uint("BA", 16)))  # fmt: skip
    header += _element("1654AE6B", _element("AE", track))
    block = _element("A3", b"\x81\x00\x00\x84\xff" + b"\xff" * 256)
    return header + _element("1F43B675", _uint("E7", 0) + block * num_blocks)


def test_a_declared_frame_count_over_the_limit_is_refused_before_the_packets_are_listed(
    monkeypatch,
):
    def listed(*args):
        raise AssertionError("the packets were listed")

    monkeypatch.setattr(video_decode, "_index_packets", listed)
    data = one_byte_packets_mp4(3000)
    with pytest.raises(MediaError, match="the video has 3000 frames; the limit is 1000"):
        decode_video(data, CONFIG, VideoLimits(max_source_frames=1000))


def test_listing_packets_stops_at_the_frame_limit():
    """5120 packets with no declared count: listed up to the limit, not to the end."""
    with pytest.raises(MediaError, match="the video has 2048 frames; the limit is 2000"):
        decode_video(laced_mkv(20), CONFIG, VideoLimits(max_source_frames=2000))


def test_listing_packets_is_held_to_the_decode_time(monkeypatch):
    def decoded(*args):
        raise AssertionError("decoding started")  # the clock must stop the listing first

    monkeypatch.setattr(video_decode, "_decode_in_order", decoded)
    monkeypatch.setattr(video_decode, "_decode_by_seeking", decoded)
    with pytest.raises(MediaError, match="decoding the video took over"):
        decode_video(laced_mkv(20), CONFIG, VideoLimits(max_decode_seconds=1e-6))


def test_the_probe_as_a_file_opens_counts_against_the_decode_time(monkeypatch):
    """FFmpeg probes a file as it opens it, reading up to 5 MB of packets (~2.6 s for a
    million one-byte ones), and the clock started after the first open (fuzz67). A probe
    that outlasts the limit now fails the decode however quick the rest is."""
    import time

    opened = video_decode._open

    def slow_first_probe(data, container_format, guard):
        monkeypatch.setattr(video_decode, "_open", opened)  # the later opens are quick
        time.sleep(0.3)
        return opened(data, container_format, guard)

    from bench.local_inputs import moving_pictures, video_bytes

    data = video_bytes(moving_pictures(32, 32, 4, salt=1), fps=4, container="mp4",
                       codec="libx264")  # fmt: skip
    limits = VideoLimits(max_decode_seconds=0.2)
    monkeypatch.setattr(video_decode, "_open", slow_first_probe)
    with pytest.raises(MediaError, match="decoding the video took over 0.2 s"):
        decode_video(data, CONFIG, limits)
    assert len(decode_video(data, CONFIG, limits).frames) == 4  # quick probes: decoded
