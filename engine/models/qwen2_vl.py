"""Qwen2-VL, Qwen2.5-VL and Qwen3-VL: a vision tower and the Qwen2 decoder behind one module
(the architectures share the decoder, the M-RoPE and the merger's output; their towers
differ, and Qwen3-VL's decoder has Qwen3's q/k norms, interleaved M-RoPE and deepstack).

The model runner calls, per step:
    rows = model.encode_images(pixel_values, grid_thw)      # uncached media, all at once
    hidden = model.forward(input_ids, positions, kv_caches, attn_metadata,
                           multimodal_embeds, multimodal_rows)
    logits = model.compute_logits(hidden[last_rows])
Build it with `engine.models.loader.load_model`, which fills the weights.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention.base import AttentionBackend, AttentionMetadata
from engine.errors import MediaError
from engine.model_config import ModelConfig
from engine.models.layers import scatter_rows
from engine.models.qwen2_5_vl_vision import Qwen25VisionTransformer
from engine.models.qwen2_decoder import Qwen2Decoder
from engine.models.qwen2_vl_vision import Qwen2VisionTransformer
from engine.models.qwen3_vl_vision import Qwen3VisionTransformer
from engine.tensor_parallel import ShardGroup


class Qwen2VLForConditionalGeneration(nn.Module):
    """Qwen2-VL or Qwen2.5-VL (by `config.vision.variant`), or the decoder alone (Qwen2,
    Llama: `config.vision` None), over a paged KV cache. Inputs are flat over all sequences of a
    step.

    Parameter names mirror the hub checkpoint ("model.layers.N...", "visual.blocks.N...")
    except the fused projections (`qkv_proj`, `gate_up_proj`), the patch embedding
    (a Linear instead of the reference's Conv3d) and the merger's `fc1` / `fc2`.
    With tied word embeddings there is no `lm_head`; logits use the embedding matrix.

    With `tensor_parallel` (rank 0 of the group; engine/tensor_parallel.py) `config` is this
    rank's shard and `forward` sends the workers their inputs before running its layers.
    """

    def __init__(
        self,
        config: ModelConfig,
        attention: AttentionBackend,
        tensor_parallel: ShardGroup | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.tensor_parallel = tensor_parallel
        self.visual: nn.Module | None = None  # a text-only model (Qwen2 or Llama)
        if config.vision is not None and config.vision.variant == "qwen2_5_vl":
            self.visual = Qwen25VisionTransformer(config.vision)
        elif config.vision is not None and config.vision.variant == "qwen3_vl":
            self.visual = Qwen3VisionTransformer(config.vision)
        elif config.vision is not None:
            self.visual = Qwen2VisionTransformer(config.vision)
        self.model = Qwen2Decoder(
            config, attention, None if tensor_parallel is None else tensor_parallel.all_reduce
        )
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        )

    def init_buffers(self) -> None:
        """Recompute constant (non-checkpoint) buffers, e.g. after `to_empty`."""
        for module in self.modules():
            if module is not self and hasattr(module, "init_buffers"):
                module.init_buffers()

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, hidden]
        return self.model.embed_tokens(input_ids)

    def encode_images(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """Encodes all items in one call; returns [sum t*h*w / merge**2, hidden], items in order.

        pixel_values [num_patches, C * T_patch * P * P] (items concatenated);
        grid_thw [num_items, 3] int64. Works for images and videos alike.
        """
        vision = self.config.vision
        if vision is None:  # a text-only model: no self.visual either
            raise MediaError("this model takes no images or videos")
        patch_dim = vision.patch_dim
        grids = grid_thw.tolist()
        merge = vision.spatial_merge_size
        if any(h % merge or w % merge or min(t, h, w) <= 0 for t, h, w in grids):
            raise MediaError(f"grid_thw {grids} is not a positive multiple of the merge size")
        num_patches = sum(t * h * w for t, h, w in grids)
        if pixel_values.dim() != 2 or tuple(pixel_values.shape) != (num_patches, patch_dim):
            raise MediaError(
                f"pixel_values shape {tuple(pixel_values.shape)} does not match "
                f"grid_thw (expected ({num_patches}, {patch_dim}))"
            )
        return self.visual(pixel_values, grid_thw)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [3, T] int64 (t, h, w rows)
        kv_caches: list[torch.Tensor],  # per layer [num_blocks, 2, block_size, KVH, D]
        attn_metadata: AttentionMetadata,
        multimodal_embeds: torch.Tensor | None = None,  # [M, encoder_width]
        multimodal_rows: torch.Tensor | None = None,  # [M] int64 flat rows, in order
    ) -> torch.Tensor:  # [T, hidden], after the final norm
        embeds = self.model.embed_tokens(input_ids)  # [T, hidden]
        deepstack = None
        if multimodal_embeds is not None and multimodal_rows is not None:
            hidden = embeds.shape[1]
            rows = multimodal_embeds.to(embeds.dtype)
            scatter_rows(embeds, multimodal_rows, rows[:, :hidden])
            if rows.shape[1] > hidden:  # Qwen3-VL: the deepstack levels follow
                deepstack = (multimodal_rows, rows[:, hidden:].view(len(rows), -1, hidden))
        if self.tensor_parallel is not None:
            with self.tensor_parallel.whole_forward():  # its broadcasts, then its layers
                self.tensor_parallel.send_forward(embeds, positions, attn_metadata)
                return self.model(embeds, positions, kv_caches, attn_metadata, deepstack)
        return self.model(embeds, positions, kv_caches, attn_metadata, deepstack)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[S, hidden] -> [S, V] in the model's dtype: the sampler casts to float32 what it
        computes with (engine/sampler.py), and skips the cast for plain greedy picks."""
        if self.lm_head is None:  # tied: the embedding matrix is the LM head
            return F.linear(hidden, self.model.embed_tokens.weight)
        return self.lm_head(hidden)
