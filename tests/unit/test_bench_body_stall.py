"""bench/body_stall.py's bodies are the JSON they claim: millions of small items."""

import json

from bench.body_stall import big_body


def test_the_bodies_hold_many_small_items():
    parts = json.loads(big_body("parts", 0.5, "m"))
    assert len(parts["messages"]) == 2048
    assert sum(len(m["content"]) for m in parts["messages"]) > 10_000
    prompts = json.loads(big_body("prompts", 0.1, "m"))
    assert prompts["prompt"][:2] == [[0], [0]] and len(prompts["prompt"]) == 25_000
