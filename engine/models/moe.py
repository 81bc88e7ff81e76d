"""A mixture-of-experts MLP (Qwen3-MoE, Qwen3-VL-MoE), computed as transformers does.

    router   softmax(x W_gate^T) in float32 -> the top_k experts per token, their
             probabilities (renormalised over the picked ones with `normalize`)
    experts  for every expert picked by some token, in expert order: its tokens'
             silu(gate) * up -> down, times the token's weight, added into the output

The experts' weights are two 3D parameters, `gate_up_proj` [E, 2 I, hidden] and
`down_proj` [E, hidden, I] (transformers' in-memory layout; engine/models/loader.py fills
them from per-expert or fused checkpoint tensors).

The loop over experts reads which experts were picked on the host, so a step with MoE
layers syncs once per layer and cannot be captured in a CUDA graph (the model runner runs
such models eagerly). A fused grouped-GEMM kernel is the GPU path still to build.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.model_config import MoEConfig
from engine.models.layers import SiluAndMul


class SparseMoE(nn.Module):
    def __init__(self, hidden_size: int, config: MoEConfig) -> None:
        super().__init__()
        self.config = config
        self.gate = nn.Linear(hidden_size, config.num_experts, bias=False)  # the router
        self.experts = MoEExperts(hidden_size, config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> [T, hidden]
        logits = self.gate(x)  # [T, E]
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, experts = probs.topk(self.config.top_k, dim=-1)  # [T, k] each
        if self.config.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return self.experts(x, experts, weights.to(logits.dtype))


class MoEExperts(nn.Module):
    def __init__(self, hidden_size: int, config: MoEConfig) -> None:
        super().__init__()
        width = config.intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(config.num_experts, 2 * width, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(config.num_experts, hidden_size, width))
        self.act = SiluAndMul()

    def forward(
        self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:  # x [T, hidden], experts / weights [T, k] -> [T, hidden]
        out = torch.zeros_like(x)
        by_slot = experts.T  # [k, T]: rows gathered slot by slot, as transformers does
        for expert in experts.unique().tolist():  # ascending, as transformers' loop
            slot, tokens = torch.where(by_slot == expert)
            hidden = self.act(F.linear(x[tokens], self.gate_up_proj[expert]))  # [n, I]
            hidden = F.linear(hidden, self.down_proj[expert]) * weights[tokens, slot, None]
            out.index_add_(0, tokens, hidden.to(out.dtype))
        return out
