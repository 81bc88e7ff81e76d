"""Benchmark (not a test; needs a GPU): decode step time against the memory-bandwidth floor.

    PYTHONPATH=. python3 bench/gpu_decode.py --sizes qwen2-vl-2b qwen2-vl-7b \\
        --batch-sizes 1 32 128 --out decode.json

For each checkpoint (random weights of the real Qwen2-VL shapes, written once under
--model-root by `engine.tiny_model`) and each mode, B prompts of --context-len random
tokens are prefilled, then --steps decode steps are timed. A step is one
`EngineCore.step_overlapped()` as the server runs it: schedule, host inputs, graph replay
(or the eager forward), logits, sampling, the host sync for the sampled tokens,
bookkeeping. Modes:

    graphs          CUDA graphs + overlap scheduling (the server's default): the next
                    step is launched before this one's tokens are read
    graphs-serial   CUDA graphs, overlap_scheduling=False: each step waits for the last
    eager           no graphs (overlap on)
    graphs-penalties  graphs, every request with repetition_penalty 1.05 (what Qwen2-VL
                    and Qwen2.5-VL checkpoints ask for): the penalties count the token in
                    flight on the device, so these steps overlap too
    graphs-openai-penalties  graphs, every request with OpenAI's presence_penalty and
                    frequency_penalty 0.5, which count each output token
    graphs-small-linear  graphs with --small-batch-linear-rows 8: up to 8 rows, the
                    decoder's projections run the Triton matrix-vector kernel, not cuBLAS
    graphs-unfused  graphs with the FlashInfer backend's rotary and K/V write as two
                    kernels, as before kernels/triton/rotary_kv_write.py
    graphs-triton-decode  graphs with decode attention on kernels/triton/
                    paged_decode_attention.py, not FlashInfer's (the backend's
                    `triton_graph_decode`)
    graphs-block64  graphs with KV-cache blocks (FlashInfer's pages) of 64 tokens, not 16
    graphs-fa3      graphs with FlashInfer's FA3 (Hopper) kernels for attention, decode
                    included, instead of FA2 (kernels/flashinfer_glue.py FLASHINFER_BACKEND;
                    its JIT module: scripts/flashinfer_jit.py --backend fa3)

"forward" is the device time of the decoder alone (CUDA events around it).

The floor of a step is the bytes it must read: every decoder weight once (final norm and
LM head included; of the embedding table only B rows, ignored) plus every sequence's K and
V history in every layer, over the device-to-device bandwidth measured here (one large copy,
bytes read + written). Issue 8's targets: step <= 1.5x the floor at batch 1, <= 2x at 128.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import random
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.device_io import DeviceTimer
from engine.models.moe import SparseMoE
from engine.process import set_intra_op_threads
from engine.protocol import EngineRequest, SamplingParams

PROFILE_STEPS = 5


@dataclass(frozen=True)
class DecodeResult:
    size: str
    mode: str  # one of MODES
    batch_size: int
    step_ms: float  # median over the timed steps
    forward_ms: float  # median device time of the decoder forward
    floor_ms: float
    weight_bytes: int
    kv_bytes: int  # KV history read by the median step

    @property
    def ratio(self) -> float:
        return self.step_ms / self.floor_ms


def measure_bandwidth(device: torch.device, num_bytes: int = 2 << 30, repeats: int = 20) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus written."""
    if device.type != "cuda":  # a smoke run on CPU: a smaller copy, the host clock
        num_bytes, repeats = num_bytes // 16, 3
    source = torch.randint(0, 255, (num_bytes,), dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    for _ in range(3):
        target.copy_(source)
    timer = DeviceTimer(device)
    timer.start()
    for _ in range(repeats):
        target.copy_(source)
    timer.stop()
    return 2 * num_bytes * repeats / timer.seconds()


def decoder_weight_bytes(model: torch.nn.Module, batch_size: int = 1) -> int:
    """Bytes a decode step of `batch_size` rows reads of the weights: the decoder layers,
    final norm and LM head (the embedding matrix when tied), not the embedding table nor
    the vision tower. Of a mixture of experts, only the experts the step's tokens pick
    (`experts_read`)."""
    decoder = model.model
    embed = decoder.embed_tokens.weight
    total = sum(p.numel() * p.element_size() for p in decoder.parameters())
    total -= embed.numel() * embed.element_size()
    for module in decoder.modules():
        if isinstance(module, SparseMoE):
            config = module.config
            expert_bytes = sum(p.numel() * p.element_size() for p in module.experts.parameters())
            read = experts_read(config.num_experts, config.top_k, batch_size)
            total -= round(expert_bytes * (1 - read / config.num_experts))
    head = embed if model.lm_head is None else model.lm_head.weight
    return total + head.numel() * head.element_size()


def experts_read(num_experts: int, top_k: int, num_tokens: int) -> float:
    """How many of a layer's experts `num_tokens` tokens pick, on average, when each picks
    `top_k` and the router spreads tokens evenly (random weights do, about): each expert
    is missed by a token with probability 1 - k / E. Qwen3-VL-30B-A3B's 128 experts, 8 a
    token: 8 at batch 1, 111.8 at 32 and 128.0 at 128."""
    return num_experts * (1 - (1 - top_k / num_experts) ** num_tokens)


def kv_bytes_per_token(core: EngineCore) -> int:
    cache = core.runner.kv_caches[0]  # [N, 2, block, KVH, D]
    return 2 * cache.shape[3] * cache.shape[4] * cache.element_size() * len(core.runner.kv_caches)


class ForwardTimer:
    """Times every `ModelRunner._forward` call on the device (read after the step's sync)."""

    def __init__(self, core: EngineCore) -> None:
        self.timers: list[DeviceTimer] = []
        runner = core.runner
        forward = runner._forward

        def timed(inputs, in_flight):
            timer = DeviceTimer(runner.device)
            timer.start()
            hidden = forward(inputs, in_flight)
            timer.stop()
            self.timers.append(timer)
            return hidden

        runner._forward = timed

    def pop_ms(self) -> list[float]:
        times = [timer.seconds() * 1000 for timer in self.timers]
        self.timers = []
        return times


def plain_token_ids(core: EngineCore) -> int:
    """Prompts draw ids below this: inside the tokenizer, and below the special tokens (an
    image placeholder in a text-only prompt fails the request)."""
    mc = core.model_config
    special = [mc.image_token_id, mc.video_token_id, mc.vision_start_token_id, *mc.eos_token_ids]
    return min(mc.vocab_size, 8000, *(i for i in special if i is not None))


# The sampling penalties of the modes that have them.
MODE_PENALTIES = {
    "graphs-penalties": {"repetition_penalty": 1.05},
    "graphs-openai-penalties": {"presence_penalty": 0.5, "frequency_penalty": 0.5},
}
# Engine settings of the modes that change one.
MODE_SETTINGS = {
    "graphs-small-linear": {"small_batch_linear_rows": 8},
    "graphs-block64": {"block_size": 64},
}
# The modes that flip a class switch of the FlashInfer backend rather than a setting: its
# rotary and K/V write as two kernels (the fused kernel writes the same bytes, so no user
# needs to choose), and graph-captured decode attention on the Triton kernel (a candidate).
UNFUSED_MODE = "graphs-unfused"
TRITON_DECODE_MODE = "graphs-triton-decode"
MODE_BACKEND_SWITCHES = {
    UNFUSED_MODE: {"fuse_rotary_kv_write": False},
    TRITON_DECODE_MODE: {"triton_graph_decode": True},
}
# The mode that measures FlashInfer's FA3 kernels (sm90) against the FA2 ones the engine runs.
FA3_MODE = "graphs-fa3"
MODES = ["graphs", "graphs-serial", "eager", *MODE_PENALTIES, *MODE_SETTINGS,
         *MODE_BACKEND_SWITCHES, FA3_MODE]  # fmt: skip


def random_prompt(rng: random.Random, length: int, vocab: int) -> list[int]:
    return [rng.randrange(vocab) for _ in range(length)]


def run_batch(core: EngineCore, timer: ForwardTimer, batch_size: int,
              args: argparse.Namespace, vocab: int, mode: str) -> tuple[float, float]:  # fmt: skip
    """Median step and forward times (ms) of `args.steps` decode steps at `batch_size`."""
    rng = random.Random(batch_size)
    sampling = SamplingParams(max_tokens=max_new_tokens(args), temperature=0.0, ignore_eos=True,
                              **MODE_PENALTIES.get(mode, {}))  # fmt: skip
    ids = [f"b{batch_size}-{i}" for i in range(batch_size)]
    for request_id in ids:
        prompt = random_prompt(rng, args.context_len, vocab)
        core.add_request(EngineRequest(request_id=request_id, prompt_token_ids=prompt,
                                       sampling=sampling))  # fmt: skip
    started: set[str] = set()
    while len(started) < batch_size:  # prefill, chunked by the token budget
        for output in core.step().outputs:
            if output.error is not None:
                raise RuntimeError(f"request {output.request_id} failed: {output.error}")
            if output.new_token_ids:
                started.add(output.request_id)
    for _ in range(args.warmup_steps):
        core.step_overlapped()
    timer.pop_ms()
    step_ms = []
    for _ in range(args.steps):
        begin = time.perf_counter()
        outputs = core.step_overlapped()
        step_ms.append((time.perf_counter() - begin) * 1000)
        if outputs.stats.num_scheduled_tokens != batch_size:
            raise RuntimeError(
                f"a timed step was not a pure decode step of the whole batch: {outputs.stats}"
            )
    forward_ms = timer.pop_ms()
    if args.profile_dir and batch_size in args.profile_batch_sizes:
        profile_steps(core, f"{mode}-{core.config.attention_backend}-b{batch_size}", args)
    core.abort_requests(ids)
    while core.has_unfinished_requests():
        core.step()
    return median(step_ms), median(forward_ms)


def profile_steps(core: EngineCore, name: str, args: argparse.Namespace) -> None:
    """PROFILE_STEPS more decode steps under torch.profiler: the busiest ops on the host and
    on the device to stderr, a Chrome trace (Perfetto / chrome://tracing) to --profile-dir."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities, with_stack=True) as prof:
        for _ in range(PROFILE_STEPS):
            core.step_overlapped()
    path = Path(args.profile_dir) / f"{Path(core.config.model).name}-{name}.json.gz"
    path.parent.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(path))
    print_top_ops(prof, f"{path.name}, {PROFILE_STEPS} steps")


def print_top_ops(prof, label: str, limit: int = 15) -> None:
    """The busiest ops by host and by device time of a finished torch.profiler run, to
    stderr: total microseconds, calls, name."""
    # Ops and kernels only: with_stack also records every Python call as an event.
    ops = [e for e in prof.key_averages() if ".py(" not in e.key and "built-in" not in e.key]
    for field in ("self_cpu_time_total", "self_device_time_total"):
        print(f"--- {label}: top {field} (us, calls)", file=sys.stderr)
        for event in sorted(ops, key=lambda e: getattr(e, field), reverse=True)[:limit]:
            print(f"{getattr(event, field):10.0f} {event.count:6d}  {event.key[:90]}",
                  file=sys.stderr)  # fmt: skip


def max_new_tokens(args: argparse.Namespace) -> int:
    """Enough for every timed step: the prompts prefilled first decode while later ones are
    still prefilling, so they run ahead by up to the number of prefill steps."""
    prefill_steps = -(-max(args.batch_sizes) * args.context_len // args.max_num_batched_tokens)
    return args.warmup_steps + args.steps + PROFILE_STEPS + prefill_steps + 2


def median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2]


def ensure_model(root: Path, size: str, device: str) -> Path:
    path = root / size
    if not (path / "config.json").exists():
        from engine.tiny_model import make_tiny_model

        print(f"writing the {size} checkpoint to {path}", file=sys.stderr)
        make_tiny_model(path, seed=0, size=size, device=device)
    return path


def bench_size(size: str, args: argparse.Namespace, bandwidth: float) -> list[DecodeResult]:
    model_dir = ensure_model(Path(args.model_root), size, args.device)
    max_batch = max(args.batch_sizes)
    max_len = args.context_len + max_new_tokens(args) + 16
    results = []
    for mode in args.modes:
        settings = MODE_SETTINGS.get(mode, {})
        block_size = settings.get("block_size", 16)
        config = EngineConfig(
            model=str(model_dir),
            device=args.device,
            dtype=args.dtype,
            attention_backend=args.attention_backend,
            enforce_eager=mode == "eager",
            overlap_scheduling=mode != "graphs-serial",
            max_num_seqs=max_batch,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_model_len=max_len,
            num_kv_blocks=max_batch * (-(-max_len // block_size)) + 16,
            enable_prefix_caching=False,
            **settings,
        )
        set_intra_op_threads(config)  # as the server's engine process does
        with backend_switches(MODE_BACKEND_SWITCHES.get(mode, {})), flashinfer_backend(mode):
            core = EngineCore(config)
        timer = ForwardTimer(core)
        per_token = kv_bytes_per_token(core)
        vocab = plain_token_ids(core)
        for batch_size in args.batch_sizes:
            step_ms, forward_ms = run_batch(core, timer, batch_size, args, vocab, mode)
            weight_bytes = decoder_weight_bytes(core.runner.model, batch_size)
            history = args.context_len + args.warmup_steps + args.steps // 2
            kv_bytes = batch_size * history * per_token
            floor_ms = (weight_bytes + kv_bytes) / bandwidth * 1000
            result = DecodeResult(size, mode, batch_size, step_ms, forward_ms, floor_ms,
                                  weight_bytes, kv_bytes)  # fmt: skip
            print(format_row(result), file=sys.stderr)
            results.append(result)
        core.close()
        del core, timer
        gc.collect()  # the core sits in reference cycles: without this, every mode's
        # weights and KV cache stay on the device (five 7B engines do not fit 80 GB)
        if args.device == "cuda":
            torch.cuda.empty_cache()
    return results


@contextlib.contextmanager
def attributes_set(target: object, values: dict[str, object]) -> Iterator[None]:
    """`target`'s attributes set to `values` inside, their old values back after."""
    defaults = {name: getattr(target, name) for name in values}
    for name, value in values.items():
        setattr(target, name, value)
    try:
        yield
    finally:
        for name, value in defaults.items():
            setattr(target, name, value)


@contextlib.contextmanager
def backend_switches(values: dict[str, bool]) -> Iterator[None]:
    """The FlashInfer backends built inside get these class switches (each backend reads
    them when it is built and keeps its own copy); the defaults come back after."""
    try:
        from engine.attention.flashinfer_backend import FlashInferAttentionBackend
    except ImportError:  # no flashinfer: the torch backend has no switches
        yield
        return
    with attributes_set(FlashInferAttentionBackend, values):
        yield


def flashinfer_backend(mode: str) -> contextlib.AbstractContextManager[None]:
    """FlashInfer's FA3 kernels for the wrappers built inside, in FA3_MODE (each wrapper
    reads the module's backend when it is built)."""
    from kernels import flashinfer_glue

    values = {"FLASHINFER_BACKEND": "fa3"} if mode == FA3_MODE else {}
    return attributes_set(flashinfer_glue, values)


def format_row(r: DecodeResult) -> str:
    return (
        f"| {r.size} | {r.mode} | {r.batch_size} | {r.step_ms:.2f} | {r.forward_ms:.2f} | "
        f"{r.floor_ms:.2f} | {r.ratio:.2f} | {r.batch_size / r.step_ms * 1000:.0f} |"
    )


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", nargs="+", default=["qwen2-vl-2b", "qwen2-vl-7b"])
    parser.add_argument("--model-root", default="/tmp/tessera-models")
    parser.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 32, 128])
    parser.add_argument("--modes", nargs="+", default=["graphs", "graphs-serial", "eager"],
                        choices=MODES)  # fmt: skip
    parser.add_argument("--attention-backend", default="flashinfer")
    parser.add_argument("--context-len", type=int, default=512)
    parser.add_argument("--warmup-steps", type=int, default=5)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--device", default="cuda", help="cpu: a smoke run of the script")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--out", help="write the results as JSON here")
    parser.add_argument("--profile-dir", help="profile a few steps per batch size; traces here")
    parser.add_argument("--profile-batch-sizes", nargs="+", type=int, default=[1],
                        help="which batch sizes --profile-dir profiles")  # fmt: skip
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device (pass --device cpu for a smoke run)", file=sys.stderr)
        return 2
    bandwidth = measure_bandwidth(device)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    print(f"device: {name}, copy bandwidth {bandwidth / 1e9:.0f} GB/s (read + written)")
    results = []
    for size in args.sizes:
        results += bench_size(size, args, bandwidth)
    print("| size | mode | batch | step ms | forward ms | floor ms | step/floor | tok/s |")
    print("|---|---|---|---|---|---|---|---|")
    for result in results:
        print(format_row(result))
    if args.out:
        payload = {
            "device": name,
            "bandwidth_bytes_per_s": bandwidth,
            "config": vars(args),
            "results": [asdict(r) | {"ratio": r.ratio} for r in results],
        }
        Path(args.out).write_text(json.dumps(payload, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
