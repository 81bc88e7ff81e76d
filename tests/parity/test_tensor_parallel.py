"""Tensor parallelism (engine/tensor_parallel.py) against transformers, token for token.

Two ranks on CPU over gloo: the decoder layers split in two (heads, KV heads and MLP width),
rank 0's engine process plus one `engine.shard_worker` process. One engine run covers
what a split decoder can get wrong: text and pictures in one batch (rank 0 embeds and
scatters the encoder rows, the worker only receives the result), prefill in 16-token
chunks that end inside pictures, and a KV pool small enough to force preemption (the
worker's cache must follow rank 0's block ids). A text-only Llama (no q/k/v biases,
llama3 rotary scaling) checks the other column-parallel layout, and prefix-cache hits; a
Qwen3 (q/k head norms, which every rank holds whole) splits alike. Also: a rank that dies
fails the engine at once instead of hanging it, and sizes that do not divide the heads are
refused before any process starts.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time

import pytest

pytest.importorskip("transformers")

from engine import LLM, SamplingParams  # noqa: E402
from engine.errors import EngineBroken, ModelLoadError  # noqa: E402
from engine.process_tree import child_pids  # noqa: E402
from engine.tiny_model import make_tiny_model  # noqa: E402
from tests.parity.test_generate import GREEDY, Reference, check, make_prompts  # noqa: E402


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return Reference(make_tiny_model(tmp_path_factory.mktemp("tp_tiny"), seed=0, size="tiny"))


def test_two_ranks_match_transformers_with_pictures_chunks_and_preemption(reference):
    prompts = make_prompts()
    with LLM(
        str(reference.model_dir),
        tensor_parallel_size=2,
        num_kv_blocks=24,  # 8 prompts need ~60 blocks at the end
        enable_prefix_caching=False,
        max_num_batched_tokens=16,
    ) as llm:
        results = llm.generate(prompts, GREEDY)
        stats = llm.last_stats
    assert sum(s.num_preemptions_total for s in stats) > 0
    assert max(s.num_scheduled_tokens for s in stats) <= 16
    check(results, reference, prompts, range(len(prompts)))


@pytest.mark.parametrize("size", ["tiny-llama", "tiny-qwen3"])  # Qwen3: whole q/k norms
def test_a_text_only_decoder_splits_alike(tmp_path, size):
    model_dir = make_tiny_model(tmp_path / size, size=size, seed=4)
    prompts = ["Once upon a time", "The quick brown fox jumps over the lazy dog, and then"]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=1)
    with LLM(str(model_dir), num_kv_blocks=64) as llm:
        whole = llm.generate(prompts, params)
    with LLM(str(model_dir), num_kv_blocks=64, tensor_parallel_size=2) as llm:
        split = llm.generate(prompts, params)
        again = llm.generate(prompts, params)  # from the workers' cached KV blocks too
        assert sum(s.prefix_cache_hits_total for s in llm.last_stats) >= 16
    assert [r.token_ids for r in again] == [r.token_ids for r in split]
    for a, b in zip(split, whole, strict=True):
        assert a.token_ids == b.token_ids
        # Two partial sums added by the all-reduce round differently from one matmul.
        assert all(
            abs(x.logprob - y.logprob) < 1e-4 for x, y in zip(a.logprobs, b.logprobs, strict=True)
        )


def test_a_dead_rank_fails_the_engine_and_no_process_is_left(reference):
    llm = LLM(str(reference.model_dir), tensor_parallel_size=2, num_kv_blocks=64)
    try:
        [worker] = [
            pid for pid in child_pids(os.getpid())
            if b"engine.shard_worker" in open(f"/proc/{pid}/cmdline", "rb").read()
        ]  # fmt: skip
        os.kill(worker, signal.SIGKILL)
        started = time.monotonic()
        # The rank that died is named, not only gloo's broken connection (fuzz47).
        with pytest.raises(EngineBroken, match=r"rank 1 exited \(code -9\); the collective"):
            llm.generate(["Hello"], SamplingParams(max_tokens=4, temperature=0.0))
        assert time.monotonic() - started < 30
    finally:
        # Also on a failure: a group left to the garbage collector blocks in zmq's term.
        llm.close()
    assert worker not in child_pids(os.getpid())  # reaped, not a zombie


@pytest.mark.parametrize("size,field", [(3, "num_attention_heads"), (4, "num_key_value_heads")])
def test_a_size_that_does_not_divide_the_model_is_refused_before_starting(reference, size, field):
    before = set(child_pids(os.getpid()))
    with pytest.raises(ModelLoadError, match=f"tensor_parallel_size {size} .*{field}"):
        LLM(str(reference.model_dir), tensor_parallel_size=size)
    assert set(child_pids(os.getpid())) == before


def test_an_llm_dropped_without_close_stops_its_workers(reference):
    """`del llm; gc.collect()` hung for ever in zmq's Context.term (the group's sockets were
    still open) and the worker stayed up."""
    import subprocess
    import sys

    script = f"""
import gc, os
from engine.process_tree import child_pids
from engine import LLM, SamplingParams
llm = LLM({str(reference.model_dir)!r}, tensor_parallel_size=2, num_kv_blocks=64)
llm.generate(["Hello"], SamplingParams(max_tokens=2, temperature=0.0))
del llm
gc.collect()
print("workers left:", len(child_pids(os.getpid())))
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=180, cwd=os.getcwd())  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert "workers left: 0" in done.stdout


def _worker_of(pid: int) -> int:
    [worker] = [
        child for child in child_pids(pid)
        if b"engine.shard_worker" in open(f"/proc/{child}/cmdline", "rb").read()
    ]  # fmt: skip
    return worker


def _on_rank_0_layer(llm: LLM, call: int, action) -> None:
    """Run `action` inside rank 0's first decoder layer on its `call`-th forward: midway
    through a step's collectives, the worker inside that forward too."""
    layer = llm.engine.runner.model.model.layers[0]
    forward, calls = layer.forward, []

    def wrapped(*args, **kwargs):
        calls.append(1)
        if len(calls) == call:
            action()
        return forward(*args, **kwargs)

    layer.forward = wrapped


def test_ctrl_c_during_a_forward_takes_effect_between_steps(reference):
    """A Ctrl-C that landed inside a forward left the worker in that forward's collectives:
    the next generate() hung until gloo's 10-minute timeout, or failed with a "collective
    mismatch" (fuzz33). It now takes effect once the step is done."""
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    long = SamplingParams(max_tokens=300, temperature=0.0, ignore_eos=True)
    with LLM(str(reference.model_dir), tensor_parallel_size=2, num_kv_blocks=64) as llm:
        [expected] = llm.generate(["Once upon a time"], params)
        _on_rank_0_layer(llm, 5, lambda: os.kill(os.getpid(), signal.SIGINT))
        with pytest.raises(KeyboardInterrupt):
            llm.generate(["a long one " * 20] * 4, long)
        del llm.engine.runner.model.model.layers[0].forward
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        [again] = llm.generate(["Once upon a time"], params)
        assert again.token_ids == expected.token_ids
        # One in the call's last step was swallowed: the call returned as if none came.
        _on_rank_0_layer(llm, 2, lambda: os.kill(os.getpid(), signal.SIGINT))
        with pytest.raises(KeyboardInterrupt):
            llm.generate(["Once upon a time"], SamplingParams(max_tokens=2, temperature=0.0))
        del llm.engine.runner.model.model.layers[0].forward
        # A Ctrl-C at the caller's prompt reaches the worker too (the process group):
        # it died of it. Rank 0 decides when the worker stops.
        os.kill(_worker_of(os.getpid()), signal.SIGINT)
        time.sleep(0.5)
        [again] = llm.generate(["Once upon a time"], params)
        assert again.token_ids == expected.token_ids


def test_an_interrupt_between_the_forwards_broadcasts_breaks_the_group(reference):
    """One inside send_forward, after the header went out and between its broadcasts, was
    outside the guarded forward: the next call's broadcasts paired with the worker's
    leftover ones (a hang until gloo's timeout; fuzz38)."""
    with LLM(str(reference.model_dir), tensor_parallel_size=2, num_kv_blocks=64) as llm:
        group = llm.engine.runner.model.tensor_parallel
        collective, calls = group._collective, []

        def interrupted_second(start):
            calls.append(1)
            if len(calls) == 2:
                raise KeyboardInterrupt  # the second Ctrl-C, which interrupts at once
            return collective(start)

        group._collective = interrupted_second
        params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        with pytest.raises(KeyboardInterrupt):
            llm.generate(["Hello there"], params)
        del group._collective
        started = time.monotonic()
        with pytest.raises(EngineBroken, match="out of step"):
            llm.generate(["Hello there"], params)
        assert time.monotonic() - started < 30


def test_an_error_midway_through_a_forward_breaks_the_group_at_once(reference):
    """Rank 0 failing inside a forward left the worker in its collectives; the engine took
    it for one step's failure and went on, into a hang or a collective mismatch. The
    group is broken from then on, and says so at once."""
    llm = LLM(str(reference.model_dir), tensor_parallel_size=2, num_kv_blocks=64)
    try:
        def fail():
            raise RuntimeError("rank 0 ran out of memory")

        _on_rank_0_layer(llm, 3, fail)
        started = time.monotonic()
        params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
        with pytest.raises(EngineBroken, match="out of step"):
            llm.generate(["Hello there"], params)
        with pytest.raises(EngineBroken, match="out of step"):
            llm.generate(["Hello"], params)
        assert time.monotonic() - started < 30
    finally:
        started = time.monotonic()
        llm.close()  # the worker is stuck in a collective: killed at once, not waited for
    assert time.monotonic() - started < 5


def test_a_closed_llm_says_so(reference):
    """With tensor-parallel ranks every prompt got a generic 500 after close() (its group's
    sockets were closed); on one rank it went on answering (fuzz33)."""
    llm = LLM(str(reference.model_dir), tensor_parallel_size=2, num_kv_blocks=64)
    llm.close()
    with pytest.raises(RuntimeError, match="closed"):
        llm.generate(["Hello"], SamplingParams(max_tokens=2))


def test_a_worker_that_dies_before_joining_fails_the_start_at_once(reference, monkeypatch):
    """Rank 0 waited out gloo's 120 s rendezvous for a worker that had died on start-up
    (the OOM killer, a failed import), then said only "Wait timeout" (fuzz33)."""
    import subprocess
    import sys

    from engine import shard_worker

    popen = subprocess.Popen

    def dying(args, **kwargs):  # a worker that reads its spec and exits at once
        code = "import sys; sys.stdin.buffer.read(); sys.exit(7)"
        return popen([sys.executable, "-c", code], **kwargs)

    monkeypatch.setattr(shard_worker.subprocess, "Popen", dying)
    started = time.monotonic()
    with pytest.raises(EngineBroken, match=r"rank 1 exited \(code 7\)"):
        LLM(str(reference.model_dir), tensor_parallel_size=2, num_kv_blocks=64)
    assert time.monotonic() - started < 30


def _tcp_addresses(pid: int) -> set[str]:
    """The local IPv4 addresses of process `pid`'s TCP sockets (from /proc)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    addresses = set()
    with open(f"/proc/{pid}/net/tcp") as table:
        for line in list(table)[1:]:
            fields = line.split()
            if fields[9] in inodes:
                hex_ip = fields[1].split(":")[0]
                addresses.add(".".join(str(int(hex_ip[i : i + 2], 16)) for i in (6, 4, 2, 0)))
    return addresses


def test_the_group_listens_on_loopback_only(reference, monkeypatch):
    """gloo listened where the host's name resolved, or on GLOO_SOCKET_IFNAME's interface:
    a LAN address on many hosts, where anyone could reach the unauthenticated group
    (fuzz33). The test points GLOO_SOCKET_IFNAME at a LAN interface where there is one."""
    lan = sorted(name for name in os.listdir("/sys/class/net") if name.startswith(("eth", "en")))
    if lan:
        monkeypatch.setenv("GLOO_SOCKET_IFNAME", lan[0])
    with LLM(str(reference.model_dir), tensor_parallel_size=2, num_kv_blocks=64) as llm:
        llm.generate(["Hello"], SamplingParams(max_tokens=2, temperature=0.0))
        [worker] = [
            pid for pid in child_pids(os.getpid())
            if b"engine.shard_worker" in open(f"/proc/{pid}/cmdline", "rb").read()
        ]  # fmt: skip
        addresses = _tcp_addresses(worker) | _tcp_addresses(os.getpid())
    assert addresses and addresses <= {"127.0.0.1"}, addresses


def test_a_worker_whose_engine_died_during_start_up_stops_at_once(reference, tmp_path):
    """It waited out gloo's 120 s rendezvous for a rank 0 that would never come, then left
    the engine's folder behind (fuzz38). Here its engine is gone from the start (another
    parent pid than its own)."""
    import subprocess
    import sys

    import msgspec

    from engine.config import EngineConfig
    from engine.shard_worker import WorkerSpec

    folder = tmp_path / "tessera-tp-test"
    folder.mkdir()
    spec = WorkerSpec(
        config=EngineConfig(model=str(reference.model_dir), tensor_parallel_size=2),
        rank=1, size=2, store_path=str(folder / "store"),
        header_addresses=[f"ipc://{folder}/rank-1"], dtype="float32",
        kv_cache_dtype="float32", parent_pid=1 if os.getpid() != 1 else 2,
    )  # fmt: skip
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "engine.shard_worker"], timeout=200,
                          input=msgspec.json.encode(spec), capture_output=True)  # fmt: skip
    assert time.monotonic() - started < 30, done.stderr[-2000:]
    assert done.returncode != 0 and not folder.exists()


def test_gloos_own_rendezvous_is_short_once_the_ranks_have_met():
    """The ranks meet in the store, watching each other (_wait_for_peers); gloo's own
    rendezvous after that took RENDEZVOUS_TIMEOUT (120 s) to notice a peer that died in
    between: a worker outlived its dead engine, and the server, by two minutes (fuzz40)."""
    import datetime

    from engine.tensor_parallel import _loopback_options

    assert _loopback_options()._timeout <= datetime.timedelta(seconds=30)
