"""Inputs made and served on this machine for the tiny checkpoint: pattern images, videos,
feature files, and an HTTP object server with per-object latency and failures.

Shared by the small benchmarks (bench/multimodal_serving.py, bench/feature_fetch.py) and
the e2e tests; it lives under bench/ because the image ships bench/ and not tests/.
"""

from __future__ import annotations

import contextlib
import io
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import torch
from PIL import Image
from safetensors.torch import save

TINY_HIDDEN = 128  # the tiny checkpoint's decoder hidden size
FEATURE_GRID = (1, 4, 4)  # 4 tokens with merge size 2


def picture(width: int, height: int, salt: int) -> Image.Image:
    """A deterministic RGB pattern; a different `salt` gives different pixels."""
    pixels = (np.arange(height * width * 3).reshape(height, width, 3) * (salt + 3)) % 251
    return Image.fromarray(pixels.astype(np.uint8))


def png_bytes(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def video_bytes(
    frames: list[Image.Image],
    *,
    fps: int = 4,
    container: str = "mp4",
    codec: str = "mpeg4",
    options: dict[str, str] | None = None,
) -> bytes:
    """The frames encoded as a video file (PyAV; mp4 + mpeg4 by default, lossy). `options`
    go to the encoder, e.g. {"g": "8", "bf": "2"}: a keyframe every 8 frames, B-frames."""
    import av

    buffer = io.BytesIO()
    with av.open(buffer, mode="w", format=container) as output:
        stream = output.add_stream(codec, rate=fps, options=options or {})
        stream.width, stream.height = frames[0].size
        stream.pix_fmt = "yuv420p"
        for image in frames:
            frame = av.VideoFrame.from_image(image)
            output.mux(stream.encode(frame))
        output.mux(stream.encode())  # flush
    return buffer.getvalue()


def moving_pictures(width: int, height: int, count: int, salt: int = 0) -> list[Image.Image]:
    """`count` frames of a deterministic pattern that shifts from frame to frame."""
    base = np.asarray(picture(width + count * 4, height, salt))
    return [
        Image.fromarray(np.ascontiguousarray(base[:, 4 * i : 4 * i + width])) for i in range(count)
    ]


def features(
    seed: int, rows: int = 4, hidden: int = TINY_HIDDEN, dtype: torch.dtype = torch.float32
) -> bytes:
    """A safetensors feature file: seeded random `embeds` [rows, hidden] and `grid_thw`."""
    generator = torch.Generator().manual_seed(seed)
    embeds = torch.randn(rows, hidden, generator=generator).to(dtype)
    return save({"embeds": embeds, "grid_thw": torch.tensor(FEATURE_GRID)})


def feature_part(url: str, grid=FEATURE_GRID, kind: str = "image_features") -> dict:
    """A chat content part that points at pre-encoded features."""
    return {"type": kind, kind: {"url": url, "grid_thw": list(grid)}}


class _Listener(ThreadingHTTPServer):
    # socketserver's default listen backlog is 5: eight fetches connecting at once can
    # overflow it, and the kernel then resends a dropped SYN only after a second, which
    # turned a 200 ms parallel fetch into 1.2 s in bench/feature_fetch.py now and then.
    request_queue_size = 128


class ObjectServer:
    """HTTP objects by path on 127.0.0.1, each with an added latency and an optional error
    status. `with ObjectServer() as store:` serves them from a background thread and shuts
    the server down on the way out. Connections are kept alive (HTTP/1.1), as object
    stores keep them."""

    def __init__(self) -> None:
        self.objects: dict[str, tuple[bytes, float, int]] = {}
        self.num_gets: dict[str, int] = {}
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            # Headers and body go out in two writes: without TCP_NODELAY the body waits
            # for the client's delayed ACK (40 ms) on every kept-alive request.
            disable_nagle_algorithm = True

            def log_message(self, *args) -> None:
                pass

            def _serve(self, with_body: bool) -> None:
                data, delay, status = server.objects.get(self.path, (b"", 0.0, 404))
                if with_body:
                    server.num_gets[self.path] = server.num_gets.get(self.path, 0) + 1
                time.sleep(delay)
                self.send_response(status)
                self.send_header("Content-Length", str(len(data) if status == 200 else 0))
                self.end_headers()
                if with_body and status == 200:
                    with contextlib.suppress(OSError):
                        self.wfile.write(data)

            def do_GET(self) -> None:
                self._serve(True)

            def do_HEAD(self) -> None:
                self._serve(False)

        self.httpd = _Listener(("127.0.0.1", 0), Handler)
        self.base_url = f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def __enter__(self) -> ObjectServer:
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc_info) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def put(self, name: str, data: bytes, *, delay: float = 0.0, status: int = 200) -> str:
        self.objects["/" + name] = (data, delay, status)
        return f"{self.base_url}/{name}"
