"""Suite-wide setup.

Without CUDA, Triton kernels can only run in Triton's CPU interpreter, and triton reads
TRITON_INTERPRET when it is first imported — by whichever test module imports it first
(collection order puts tests/gpu before tests/unit). So the switch is made here, once,
before any test module is imported.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
