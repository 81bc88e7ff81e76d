"""Benchmark (not a test; needs a GPU for its numbers): the vision tower's time per call and
per image, against a FLOP floor and against transformers' tower on the same weights.

    PYTHONPATH=. python3 bench/gpu_vision.py --size qwen2-vl-2b --images 1 8 32 \\
        --out vision.json --profile-dir /tmp/profiles

Why: in issue 8's 2B serving run the vision encoder took 7.6 s of the engine's 18.3 s of
steps, 14.6 ms of device time per 448x448 image, several times what its FLOPs cost at
H100 rates. This script says where that goes, in one short run on the device:

* each call encodes N images of --image-size (random pixels; the tower's cost does not
  depend on them) through `encode_images`, as the engine does; the time is the device
  time of the call (CUDA events; the host clock on CPU), median of --iters calls;
* `tessera` is the tower as it runs in the engine (PyTorch picks the SDPA kernel);
  `tessera-torch-ops` runs the torch ops the Triton kernels replace (the CPU path's, for
  the kernels' gain in the same run); `tessera-flash`, `tessera-efficient` and
  `tessera-cudnn` force one SDPA kernel, to see whether PyTorch's pick is the fastest
  (these four CUDA only); `transformers` is Qwen2VisionTransformerPretrainedModel (or
  Qwen2_5_VisionTransformerPretrainedModel for a Qwen2.5-VL size) with
  attn_implementation="sdpa", the same weights;
* the floor is the call's FLOPs (every GEMM and the attention products) over the rate of
  one large bf16 GEMM measured here;
* with --profile-dir, one call of `tessera` per --profile-images count runs under
  torch.profiler: the busiest host ops and device kernels go to stderr (which SDPA kernel
  ran, what the elementwise ops cost) and a Chrome trace to the folder.

On CPU (`--device cpu --size tiny --dtype float32`) it is a smoke run of the script
(tests/unit/test_gpu_vision_bench.py).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from bench.gpu_decode import ensure_model, median, print_top_ops
from engine.attention import get_attention_backend
from engine.device_io import DeviceTimer
from engine.model_config import VisionConfig
from engine.models import layers, qwen2_vl_vision
from engine.models.loader import checkpoint_files, load_model
from engine.models.qwen2_5_vl_vision import window_order

IMPLS = (
    "tessera",
    "tessera-torch-ops",
    "tessera-flash",
    "tessera-efficient",
    "tessera-cudnn",
    "transformers",
)
CUDA_ONLY = ("tessera-torch-ops", "tessera-flash", "tessera-efficient", "tessera-cudnn")
FORCED_SDPA = {
    "tessera-flash": "FLASH_ATTENTION",
    "tessera-efficient": "EFFICIENT_ATTENTION",
    "tessera-cudnn": "CUDNN_ATTENTION",
}


@dataclass(frozen=True)
class VisionResult:
    impl: str
    num_images: int
    call_ms: float | None  # median device time of one call; None: the impl cannot run here
    floor_ms: float
    flops: float
    error: str | None = None

    @property
    def per_image_ms(self) -> float | None:
        return None if self.call_ms is None else self.call_ms / self.num_images

    @property
    def ratio(self) -> float | None:
        return None if self.call_ms is None else self.call_ms / self.floor_ms


def frame_grid(vision: VisionConfig, image_size: int) -> tuple[int, int, int]:
    """grid_thw of one square image of `image_size` pixels (a multiple of patch x merge)."""
    factor = vision.patch_size * vision.spatial_merge_size
    if image_size % factor:
        raise ValueError(f"--image-size must be a multiple of {factor}, got {image_size}")
    side = image_size // vision.patch_size
    return (1, side, side)


def tower_flops(vision: VisionConfig, grids: Sequence[tuple[int, int, int]]) -> float:
    """FLOPs of one call: patch embedding, every block's GEMMs (QKV, output, the MLP's two
    or, gated in Qwen2.5-VL, three) and attention products (QK^T and PV within each frame,
    or each window in Qwen2.5-VL's window blocks), the merger's two GEMMs. Norms and
    elementwise ops are left out (memory-bound, small)."""
    embed, hidden = vision.embed_dim, vision.intermediate_size
    is_gated = vision.variant == "qwen2_5_vl"
    rows = sum(t * h * w for t, h, w in grids)
    mlp = (3 if is_gated else 2) * embed * hidden
    per_row = vision.patch_dim * embed + vision.depth * (4 * embed * embed + mlp)
    frames = qwen2_vl_vision.frame_lengths(grids)
    full_blocks, window_blocks = vision.depth, 0
    windows: list[int] = []
    if is_gated:
        merged_pixels = vision.patch_size * vision.spatial_merge_size
        merge = vision.spatial_merge_size
        _, windows = window_order(grids, merge, vision.window_size // merged_pixels)
        full_blocks = len([i for i in vision.fullatt_block_indexes if i < vision.depth])
        window_blocks = vision.depth - full_blocks
    attention = 2 * embed * (
        full_blocks * sum(n * n for n in frames) + window_blocks * sum(n * n for n in windows)
    )
    merge = vision.spatial_merge_size**2
    merged_dim = embed * merge
    merger = rows // merge * (merged_dim * merged_dim + merged_dim * vision.out_hidden_size)
    return 2.0 * (rows * per_row + attention + merger)  # a multiply-add is two FLOPs


def measure_gemm_rate(device: torch.device, dtype: torch.dtype) -> float:
    """FLOP/s of one large square GEMM in `dtype` (a smaller one on CPU, a smoke run)."""
    size, repeats = (8192, 20) if device.type == "cuda" else (512, 3)
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    timer = DeviceTimer(device)
    timer.start()
    for _ in range(repeats):
        a @ b
    timer.stop()
    return 2.0 * size**3 * repeats / timer.seconds()


def load_transformers_tower(model_dir: Path, dtype: torch.dtype, device: torch.device):
    """transformers' Qwen2-VL or Qwen2.5-VL vision tower (SDPA attention) with the
    checkpoint's weights."""
    from bench.hf_baseline import patch_broken_torchvision

    patch_broken_torchvision()
    from transformers import AutoConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
        Qwen2_5_VisionTransformerPretrainedModel,
    )
    from transformers.models.qwen2_vl.modeling_qwen2_vl import (
        Qwen2VisionTransformerPretrainedModel,
    )

    config = AutoConfig.from_pretrained(model_dir)
    tower_class = (
        Qwen2_5_VisionTransformerPretrainedModel
        if config.model_type == "qwen2_5_vl"
        else Qwen2VisionTransformerPretrainedModel
    )
    config = config.vision_config
    tower = tower_class._from_config(
        config, attn_implementation="sdpa", dtype=dtype
    )
    state = {}
    for file in checkpoint_files(model_dir):
        with safe_open(str(file), framework="pt", device="cpu") as reader:
            for name in reader.keys():
                for prefix in ("model.visual.", "visual."):
                    if name.startswith(prefix):
                        state[name.removeprefix(prefix)] = reader.get_tensor(name)
    tower.load_state_dict(state, strict=True)
    return tower.to(device).eval()


@contextlib.contextmanager
def impl_context(impl: str) -> Iterator[None]:
    """What `impl` changes in the tower while its calls run."""
    if impl in FORCED_SDPA:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel(getattr(SDPBackend, FORCED_SDPA[impl])):
            yield
    elif impl == "tessera-torch-ops":  # the CPU path's elementwise torch ops, on the GPU
        modules = (layers, qwen2_vl_vision)  # the rotary and quick_gelu switches
        saved = [module.use_triton for module in modules]
        for module in modules:
            module.use_triton = lambda x: False
        try:
            yield
        finally:
            for module, use_triton in zip(modules, saved, strict=True):
                module.use_triton = use_triton
    else:
        yield


def time_calls(call: Callable[[], torch.Tensor], device: torch.device, iters: int) -> float:
    """Median device time (ms) of `iters` calls, after two warm-up calls."""
    for _ in range(2):
        call()
    times = []
    for _ in range(iters):
        timer = DeviceTimer(device)
        timer.start()
        call()
        timer.stop()
        times.append(timer.seconds() * 1000)
    return median(times)


def profile_call(call: Callable[[], torch.Tensor], name: str, profile_dir: Path) -> None:
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        call()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    profile_dir.mkdir(parents=True, exist_ok=True)
    path = profile_dir / f"{name}.json.gz"
    prof.export_chrome_trace(str(path))
    print_top_ops(prof, f"{path.name}, one call")


@torch.inference_mode()
def run(args: argparse.Namespace) -> tuple[list[VisionResult], dict]:
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    model_dir = ensure_model(Path(args.model_root), args.size, args.device)
    model = load_model(str(model_dir), dtype=dtype, device=device,
                       attention=get_attention_backend("torch"))  # fmt: skip
    vision = model.config.vision
    towers = {impl: model.encode_images for impl in args.impls if impl != "transformers"}
    if "transformers" in args.impls:
        hf = load_transformers_tower(model_dir, dtype, device)
        # As transformers' own callers do, grid_thw goes with the pixels to the device.
        towers["transformers"] = lambda pixels, grid: (
            hf(pixels, grid_thw=grid.to(device)).pooler_output
        )
    gemm_rate = measure_gemm_rate(device, dtype)
    grid = frame_grid(vision, args.image_size)
    gen = torch.Generator(device=device).manual_seed(0)
    results, agreement = [], {}
    for num_images in args.images:
        grids = [grid] * num_images
        rows = num_images * grid[0] * grid[1] * grid[2]
        pixels = torch.randn(rows, vision.patch_dim, generator=gen, device=device, dtype=dtype)
        grid_thw = torch.tensor(grids, dtype=torch.long)
        flops = tower_flops(vision, grids)
        floor_ms = flops / gemm_rate * 1000
        outputs = {}
        for impl, tower in towers.items():
            call = functools.partial(tower, pixels, grid_thw)
            try:
                with impl_context(impl):
                    call_ms = time_calls(call, device, args.iters)
                    outputs[impl] = call()
            except RuntimeError as exc:  # a forced SDPA kernel that cannot take these inputs
                result = VisionResult(impl, num_images, None, floor_ms, flops, str(exc)[:200])
            else:
                result = VisionResult(impl, num_images, call_ms, floor_ms, flops)
            print(format_row(result), file=sys.stderr)
            results.append(result)
            if args.profile_dir and impl == "tessera" and num_images in args.profile_images:
                name = f"{args.size}-vision-{num_images}x{args.image_size}"
                profile_call(call, name, Path(args.profile_dir))
        if "tessera" in outputs and "transformers" in outputs:
            ours, theirs = outputs["tessera"].float(), outputs["transformers"].float()
            agreement[num_images] = float((ours - theirs).abs().max() / theirs.abs().max())
    info = {"gemm_flops_per_s": gemm_rate, "grid_thw": grid, "max_rel_diff_vs_hf": agreement}
    return results, info


def format_row(r: VisionResult) -> str:
    if r.call_ms is None:
        return f"| {r.impl} | {r.num_images} | - | - | {r.floor_ms:.2f} | - | {r.error} |"
    return (
        f"| {r.impl} | {r.num_images} | {r.call_ms:.2f} | {r.per_image_ms:.2f} | "
        f"{r.floor_ms:.2f} | {r.ratio:.2f} | |"
    )


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="qwen2-vl-2b", help="engine.tiny_model size")
    parser.add_argument("--model-root", default="/tmp/tessera-models")
    parser.add_argument("--images", nargs="+", type=int, default=[1, 8, 32],
                        help="images per call")  # fmt: skip
    parser.add_argument("--image-size", type=int, default=448, help="square, in pixels")
    parser.add_argument("--impls", nargs="+", default=list(IMPLS), choices=IMPLS)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--device", default="cuda", help="cpu: a smoke run of the script")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--out", help="write the results as JSON here")
    parser.add_argument("--profile-dir", help="profile one `tessera` call; traces here")
    parser.add_argument("--profile-images", nargs="+", type=int, default=[1, 32],
                        help="which image counts --profile-dir profiles")  # fmt: skip
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device (pass --device cpu for a smoke run)", file=sys.stderr)
        return 2
    if args.device != "cuda":
        args.impls = [impl for impl in args.impls if impl not in CUDA_ONLY]
    results, info = run(args)
    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(f"device: {name}, {args.dtype} GEMM {info['gemm_flops_per_s'] / 1e12:.1f} TFLOP/s, "
          f"{args.size} tower, {args.image_size}x{args.image_size} images "
          f"(grid {info['grid_thw']})")  # fmt: skip
    print("| impl | images | call ms | ms per image | floor ms | call/floor | |")
    print("|---|---|---|---|---|---|---|")
    for result in results:
        print(format_row(result))
    for num_images, diff in info["max_rel_diff_vs_hf"].items():
        print(f"{num_images} images: max |tessera - transformers| / max |transformers| "
              f"= {diff:.2e}")  # fmt: skip
    if args.out:
        payload = {
            "device": name,
            "config": vars(args),
            **info,
            "results": [
                asdict(r) | {"per_image_ms": r.per_image_ms, "ratio": r.ratio} for r in results
            ],
        }
        Path(args.out).write_text(json.dumps(payload, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
