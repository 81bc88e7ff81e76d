"""transformers' greedy continuation of a chat with images and videos: the oracle that the
parity and e2e tests hold Tessera to.

`Qwen2VLProcessor` cannot be built here (transformers 5's video processor imports
torchvision, which is not installed), so its one job is done by hand: the chat template
from the tokenizer, each `<|image_pad|>` / `<|video_pad|>` widened to the item's token
count, `mm_token_type_ids` (1 image, 2 video) for M-RoPE. Images go through transformers'
own PIL image processor. Videos come as Tessera's processed frames (`ProcessedImage` from
engine/multimodal/video.py), whose levels equal what `Qwen2VLVideoProcessor` makes of the
same frames (checked against it in tests/unit/test_video.py where torchvision exists, and
in docs/multimodal.md), so the model is what is compared. For Qwen2.5-VL each video also
carries its `second_per_grid_ts` (what Qwen2_5_VLProcessor computes from the sampled fps).
For Qwen3-VL a video's placeholder becomes what Qwen3VLProcessor.replace_video_token writes:
per temporal patch, its time ("<1.5 seconds>") and its own vision start, pads and end.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import transformers


class HFGreedy:
    def __init__(self, model_dir) -> None:
        # The checkpoint's own class: Qwen2VLForConditionalGeneration or Qwen2_5_VL...
        config = json.loads((Path(model_dir) / "config.json").read_text())
        self.architecture = config["architectures"][0]
        model_class = getattr(transformers, self.architecture)
        self.model = model_class.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.model.generation_config.eos_token_id = None  # a fixed length, like ignore_eos
        self.tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
        self.image_processor = transformers.AutoImageProcessor.from_pretrained(model_dir)

    def inputs(self, messages: list[dict], images=(), videos=(), image_size=None) -> dict:
        """`messages` use {"type": "image"} / {"type": "video"} parts, one per item of
        `images` (PIL) / `videos` (processed videos), in order. `image_size` overrides the
        image processor's pixel bounds ({"shortest_edge": min, "longest_edge": max})."""
        text = self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )
        merge = self.image_processor.merge_size
        extra: dict = {}
        counts = {"<|image_pad|>": [], "<|video_pad|>": []}
        if images:
            sizing = {"size": image_size} if image_size else {}
            pixels = self.image_processor(images=list(images), return_tensors="pt", **sizing)
            extra.update(pixels)
            counts["<|image_pad|>"] = [int(g.prod()) // merge**2 for g in pixels["image_grid_thw"]]
        if videos:
            extra["pixel_values_videos"] = torch.cat([v.pixel_values for v in videos])
            extra["video_grid_thw"] = torch.tensor([list(v.grid_thw) for v in videos])
            counts["<|video_pad|>"] = [v.num_tokens for v in videos]
            if self.architecture == "Qwen2_5_VLForConditionalGeneration":
                # float32, as the processor's BatchFeature makes of its list of floats
                seconds = [v.second_per_grid_t for v in videos]
                extra["second_per_grid_ts"] = torch.tensor(seconds, dtype=torch.float32)
        expansions = {pad: [pad * n for n in numbers] for pad, numbers in counts.items()}
        if self.architecture.startswith("Qwen3VL"):  # Qwen3-VL and Qwen3-VL-MoE
            expansions["<|video_pad|>"] = [_timestamped_frames(v) for v in videos]
        for pad, replacements in expansions.items():
            pieces = text.split(pad)
            text = pieces[0] + "".join(
                replacement + piece
                for replacement, piece in zip(replacements, pieces[1:], strict=True)
            )
        inputs = dict(self.tokenizer(text, return_tensors="pt"))
        ids = inputs["input_ids"]
        image_id, video_id = self.tokenizer.convert_tokens_to_ids(list(counts))
        inputs["mm_token_type_ids"] = (ids == image_id).int() + 2 * (ids == video_id).int()
        return {**inputs, **extra}

    def generate(self, inputs: dict, num_tokens: int) -> list[int]:
        with torch.no_grad():
            out = self.model.generate(
                **inputs, max_new_tokens=num_tokens, min_new_tokens=num_tokens, do_sample=False
            )
        return out[0, inputs["input_ids"].shape[1] :].tolist()


def _timestamped_frames(video) -> str:
    """Qwen3VLProcessor.replace_video_token's text for one processed video."""
    per_frame = video.num_tokens // len(video.frame_seconds)
    return "".join(
        f"<{seconds:.1f} seconds><|vision_start|>" + "<|video_pad|>" * per_frame + "<|vision_end|>"
        for seconds in video.frame_seconds
    )


def hf_text_tokens(model_dir, prompt: str, **generate_options) -> list[int]:
    """transformers' greedy continuation of raw text `prompt` (its EOS kept: it can stop),
    with generate()'s own options (max_new_tokens, bad_words_ids, sequence_bias, ...)."""
    architecture = json.loads((Path(model_dir) / "config.json").read_text())["architectures"][0]
    model = getattr(transformers, architecture).from_pretrained(model_dir, dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    ids = tokenizer(prompt, return_tensors="pt")
    with torch.no_grad():
        out = model.eval().generate(**ids, do_sample=False, **generate_options)
    return out[0, ids["input_ids"].shape[1] :].tolist()
