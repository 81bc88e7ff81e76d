"""A mixture-of-experts MLP (Qwen3-MoE, Qwen3-VL-MoE), computed as transformers does.

    router   softmax(x W_gate^T) in float32 -> the top_k experts per token, their
             probabilities (renormalised over the picked ones with `normalize`)
    experts  every token's picked experts: silu(gate) * up -> down, times the token's
             weight, added into its output row expert by expert, in expert order

The experts' weights are two 3D parameters, `gate_up_proj` [E, 2 I, hidden] and
`down_proj` [E, hidden, I] (transformers' in-memory layout; engine/models/loader.py fills
them from per-expert or fused checkpoint tensors).

Two ways to run the experts, equal in float32 at the test widths and within float32
rounding at real ones (tests/unit/test_moe.py, bench/moe.py):

* grouped (`F.grouped_mm`, where the widths suit it): the T x k (token, expert) rows sorted
  by expert, then one grouped matmul for gate-up and one for down over the experts'
  groups. Group sizes stay on the device: no host sync, two matmul launches per layer.
* a loop over the picked experts (transformers' own), reading which were picked on the
  host: one sync per layer. Used in float32 on a CPU, where it is transformers'
  arithmetic bit for bit (what the float32 parity tests compare against, as
  cpu_prepack.py keeps float32 on F.linear), and where grouped_mm is missing or refuses
  the shapes.

On CUDA the model runner captures decode steps in CUDA graphs when `runs_without_sync`
says the grouped path queues no host sync on this device and dtype (a graph cannot
capture a sync); otherwise such a model decodes eagerly.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from engine.model_config import MoEConfig
from engine.models.layers import SiluAndMul

logger = logging.getLogger(__name__)

# grouped_mm's rule: every non-unit stride a multiple of 16 bytes.
GROUPED_MM_ALIGNMENT = 16


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
        self.use_grouped = hasattr(F, "grouped_mm")  # off for good if it ever fails

    def forward(
        self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:  # x [T, hidden], experts / weights [T, k] -> [T, hidden]
        if self.use_grouped and self._suits_grouped(x):
            try:
                return self.grouped(x, experts, weights)
            except RuntimeError:  # e.g. a GPU whose grouped GEMM kernels it lacks
                logger.warning("grouped_mm failed; the experts run one by one", exc_info=True)
                self.use_grouped = False
        return self.loop(x, experts, weights)

    def _suits_grouped(self, x: torch.Tensor) -> bool:
        if x.dtype == torch.float32 and x.device.type == "cpu":
            return False  # the reference arithmetic (see the module docstring)
        element = x.element_size()
        hidden, width = self.down_proj.shape[1:]
        return (hidden * element) % GROUPED_MM_ALIGNMENT == 0 and (
            width * element
        ) % GROUPED_MM_ALIGNMENT == 0

    def grouped(
        self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        num_experts, top_k = self.gate_up_proj.shape[0], experts.shape[1]
        picks = experts.flatten()  # [T * k], token-major
        order = torch.argsort(picks, stable=True)  # rows grouped by expert, ascending
        tokens = order // top_k  # [T * k] the token of each sorted row
        counts = torch.zeros(num_experts, dtype=torch.int32, device=x.device)
        counts.scatter_add_(0, picks, torch.ones_like(picks, dtype=torch.int32))
        ends = counts.cumsum(0, dtype=torch.int32)  # [E] each group's end row
        hidden = F.grouped_mm(x[tokens], self.gate_up_proj.transpose(1, 2), offs=ends)
        hidden = self.act(hidden)  # [T * k, I]
        hidden = F.grouped_mm(hidden, self.down_proj.transpose(1, 2), offs=ends)
        hidden = hidden * weights.flatten()[order, None]  # [T * k, hidden]
        # Sorted rows reach each output row in expert order, as the loop adds them.
        return torch.zeros_like(x).index_add_(0, tokens, hidden.to(x.dtype))

    def loop(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        by_slot = experts.T  # [k, T]: rows gathered slot by slot, as transformers does
        for expert in experts.unique().tolist():  # ascending, as transformers' loop
            slot, tokens = torch.where(by_slot == expert)
            hidden = self.act(F.linear(x[tokens], self.gate_up_proj[expert]))  # [n, I]
            hidden = F.linear(hidden, self.down_proj[expert]) * weights[tokens, slot, None]
            out.index_add_(0, tokens, hidden.to(out.dtype))
        return out


def runs_without_sync(model: nn.Module, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether every mixture-of-experts layer of `model` runs its grouped path on `device`
    in `dtype` without a host sync (True for a model without one): probed once, on two
    tokens of the first layer's experts, under `torch.cuda.set_sync_debug_mode("error")`,
    since a fallback inside `grouped_mm` could itself read the group sizes on the host."""
    layers = [module for module in model.modules() if isinstance(module, MoEExperts)]
    if not layers:
        return True
    experts = layers[0]
    hidden_size = experts.down_proj.shape[1]
    x = torch.zeros(2, hidden_size, dtype=dtype, device=device)
    if device.type != "cuda" or not (experts.use_grouped and experts._suits_grouped(x)):
        return False
    picks = torch.zeros(2, 1, dtype=torch.long, device=device)
    weights = torch.ones(2, 1, dtype=dtype, device=device)
    try:
        with torch.no_grad(), sync_debug_errors():
            experts.grouped(x, picks, weights)
        torch.cuda.synchronize(device)
    except RuntimeError:
        logger.info("the grouped experts sync or fail here", exc_info=True)
        return False
    return True


@contextmanager
def sync_debug_errors() -> Iterator[None]:
    """A host sync on CUDA raises RuntimeError inside this block."""
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(previous)
