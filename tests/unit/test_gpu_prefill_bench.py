"""bench/gpu_prefill.py's CPU smoke run: the per-step bookkeeping a GPU run depends on."""

from __future__ import annotations

import json

from bench import gpu_prefill


def test_cpu_smoke_run_times_every_prefill_step(tmp_path, capsys):
    # 4 requests of a 56x56 image (16 tokens) and ~10 words through a 64-token budget:
    # several steps, some with two images, and chunks that start inside a prompt.
    out = tmp_path / "prefill.json"
    argv = [
        "--device", "cpu", "--dtype", "float32", "--attention-backend", "torch",
        "--size", "tiny", "--model-root", str(tmp_path / "models"), "--requests", "4",
        "--image-size", "56", "--prompt-len", "10", "--max-num-batched-tokens", "64",
        "--out", str(out), "--profile-dir", str(tmp_path / "profiles"),
    ]  # fmt: skip
    assert gpu_prefill.main(argv) == 0
    steps = json.loads(out.read_text())["steps"]
    assert len(steps) >= 2 and sum(s["images"] for s in steps) == 4
    assert all(0 < s["tokens"] <= 64 for s in steps)
    assert all(s["wall_ms"] > 0 and s["forward_ms"] > 0 and s["floor_ms"] > 0 for s in steps)
    assert all(s["encoder_ms"] > 0 for s in steps if s["images"])
    printed = capsys.readouterr().out
    assert printed.count("\n| ") == len(steps) + 2  # header, rows, the total
    assert [p.name for p in (tmp_path / "profiles").iterdir()] == ["tiny-prefill-4.json.gz"]


def test_a_chunk_attends_to_its_history_and_itself_causally():
    counter = gpu_prefill.FlopCounter.__new__(gpu_prefill.FlopCounter)
    counter.layer_params, counter.attention_width, counter.num_layers = 10, 4, 2
    counter.lm_head, counter.vision = 7, None
    # A chunk of 3 after 5 tokens: its queries see 6, 7 and 8 keys (21); a whole prompt
    # of 2: 1 and 2 keys (3). QK^T and PV, 2 FLOPs a multiply-add, 4 wide, 2 layers.
    attention = 2 * 2 * 4 * (21 + 3) * 2
    assert counter.step([(5, 3), (0, 2)], num_sampled=1, num_images=0) == (
        2 * 10 * 5 + attention + 2 * 7 * 1
    )
