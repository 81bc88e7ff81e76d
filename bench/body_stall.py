"""How long one large request body stalls the others: a chat stream runs while a body of
millions of small JSON items (empty text parts, or one-token prompts) is posted, and the
longest gap between the stream's chunks and the slowest `/health` answer are printed.

    python -m server.cli serve --port 8000 &
    python -m bench.body_stall --port 8000 --kind parts --mb 60

Such bodies are refused (server/json_body.py, the list caps of server/openai_models.py);
before, their parsing and validation held the API's event loop for tens of seconds.
"""

from __future__ import annotations

import argparse
import json
import threading
import time

import httpx


def big_body(kind: str, megabytes: float, model: str) -> bytes:
    """About `megabytes` of JSON: 2048 messages of empty text parts, or `[0]` prompts."""
    head = '{"model": ' + json.dumps(model) + ', "max_tokens": 2, '
    if kind == "parts":
        part = '{"type":"text","text":""}'
        per_message = int(megabytes * 1e6 / len(part)) // 2048 + 1
        message = '{"role":"user","content":[' + ",".join([part] * per_message) + "]}"
        return (head + '"messages":[' + ",".join([message] * 2048) + "]}").encode()
    count = int(megabytes * 1e6 / 4)
    return (head + '"prompt":[' + ",".join(["[0]"] * count) + "]}").encode()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--kind", choices=["parts", "prompts"], default="parts")
    parser.add_argument("--mb", type=float, default=60.0)
    args = parser.parse_args()
    base = f"http://127.0.0.1:{args.port}"
    model = httpx.get(base + "/v1/models").json()["data"][0]["id"]
    chunk_times: list[float] = []

    def stream() -> None:
        body = {"model": model, "messages": [{"role": "user", "content": "hello"}],
                "max_tokens": 2000, "ignore_eos": True, "stream": True}  # fmt: skip
        with httpx.stream("POST", base + "/v1/chat/completions", json=body, timeout=600) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    chunk_times.append(time.monotonic())

    streamer = threading.Thread(target=stream, daemon=True)
    streamer.start()
    while len(chunk_times) < 20:
        time.sleep(0.01)
    data = big_body(args.kind, args.mb, model)
    health: list[float] = []
    done = threading.Event()

    def probe() -> None:
        while not done.is_set():
            started = time.monotonic()
            httpx.get(base + "/health", timeout=600)
            health.append(time.monotonic() - started)
            time.sleep(0.05)

    prober = threading.Thread(target=probe, daemon=True)
    prober.start()
    started = time.monotonic()
    response = httpx.post(base + "/v1/chat/completions" if args.kind == "parts"
                          else base + "/v1/completions", content=data,
                          headers={"content-type": "application/json"}, timeout=600)  # fmt: skip
    ended = time.monotonic()
    done.set()
    prober.join()
    during = [t for t in chunk_times if started <= t <= ended + 0.5]
    gaps = [b - a for a, b in zip(during, during[1:], strict=False)] or [0.0]
    print(f"body {len(data) / 1e6:.1f} MB: {response.status_code} in {ended - started:.2f} s")
    print(f"longest gap between the stream's chunks meanwhile: {max(gaps):.3f} s")
    print(f"slowest /health meanwhile: {max(health or [0.0]):.3f} s")


if __name__ == "__main__":
    main()
