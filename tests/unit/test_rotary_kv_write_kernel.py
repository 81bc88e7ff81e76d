"""The fused rotary + KV-write kernel against the two kernels it replaces and their torch
references, on CPU under TRITON_INTERPRET=1 (small shapes): qk and the cache must come out
bit for bit the same.

Skipped cleanly when triton is not installed.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first triton import

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from engine.models.layers import rotary_tables  # noqa: E402
from kernels import reference  # noqa: E402
from kernels.triton.checks import KernelArgumentError  # noqa: E402
from kernels.triton.kv_cache_write import write_kv_cache  # noqa: E402
from kernels.triton.rotary import rotary_folded_  # noqa: E402
from kernels.triton.rotary_kv_write import rotary_kv_write_  # noqa: E402

FP8 = torch.float8_e4m3fn

# (tokens, q heads, kv heads, head_dim, block_size, num_blocks): one token (a decode step),
# heads that do not fill the kernel's head blocks, GQA and MHA, head_dim not a power of 2.
SHAPES = [(1, 12, 2, 16, 4, 3), (7, 4, 4, 8, 4, 4), (5, 6, 3, 24, 8, 2), (3, 7, 1, 128, 16, 2)]


def _step(shape, dtype, seed=0):
    """A fused QKV output as the model makes it, its rotary tables and distinct slots."""
    tokens, heads, kv_heads, head_dim, block_size, num_blocks = shape
    generator = torch.Generator().manual_seed(seed)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=generator).to(dtype)
    angles = torch.rand(tokens, head_dim // 2, generator=generator) * 100
    angles = torch.cat((angles, angles), dim=-1)
    cos, sin = rotary_tables(angles.cos().to(dtype), angles.sin().to(dtype))
    slots = torch.randperm(block_size * num_blocks, generator=generator)[:tokens]
    return qkv, cos, sin, slots


def _views(qkv, shape):
    tokens, heads, kv_heads, head_dim, _, _ = shape
    qk = qkv[:, : (heads + kv_heads) * head_dim].view(tokens, heads + kv_heads, head_dim)
    value = qkv[:, (heads + kv_heads) * head_dim :].view(tokens, kv_heads, head_dim)
    return qk, value


def _cache(shape, dtype):
    _, _, kv_heads, head_dim, block_size, num_blocks = shape
    # not zeros: slots the step does not own must come out as they went in
    return torch.full((num_blocks, 2, block_size, kv_heads, head_dim), 3.0).to(dtype)


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)))


def _two_kernels(qkv, cos, sin, slots, shape, cache, scales):
    qk, value = _views(qkv, shape)
    rotary_folded_(qk, cos, sin)
    write_kv_cache(qk[:, shape[1] :], value, cache, slots, *scales)


def _references(qkv, cos, sin, slots, shape, cache, scales):
    qk, value = _views(qkv, shape)
    qk.copy_(reference.rotary_folded(qk, cos, sin))
    reference.write_kv_cache(qk[:, shape[1] :], value, cache, slots, *scales)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fused_equals_rotary_then_kv_write_bit_for_bit(shape, dtype):
    qkv, cos, sin, slots = _step(shape, dtype)
    fused_qkv, fused_cache = qkv.clone(), _cache(shape, dtype)
    qk, value = _views(fused_qkv, shape)
    assert rotary_kv_write_(qk, value, cos, sin, fused_cache, slots) is qk
    expected_qkv, expected_cache = qkv.clone(), _cache(shape, dtype)
    _two_kernels(expected_qkv, cos, sin, slots, shape, expected_cache, ())
    assert _same_bytes(fused_qkv, expected_qkv)  # v untouched too
    assert _same_bytes(fused_cache, expected_cache)
    # The torch path: the same in float32; bf16 / fp16 within two roundings (the interpreter
    # truncates float32 -> bf16 where torch and the compiled kernel round to nearest even)
    torch_qkv, torch_cache = qkv.clone(), _cache(shape, dtype)
    _references(torch_qkv, cos, sin, slots, shape, torch_cache, ())
    tolerance = {} if dtype == torch.float32 else {"atol": 1e-2, "rtol": 2**-5}  # two units
    torch.testing.assert_close(fused_qkv, torch_qkv, **tolerance)
    torch.testing.assert_close(fused_cache, torch_cache, **tolerance)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("per_head", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_fp8_cache_equals_the_two_kernels(shape, per_head, dtype):
    kv_heads = shape[2]
    qkv, cos, sin, slots = _step(shape, dtype, seed=1)
    count = kv_heads if per_head else 1
    scales = (torch.linspace(0.01, 0.05, count), torch.linspace(0.02, 0.03, count))
    fused_qkv, fused_cache = qkv.clone(), _cache(shape, FP8)
    qk, value = _views(fused_qkv, shape)
    rotary_kv_write_(qk, value, cos, sin, fused_cache, slots, *scales)
    expected_qkv, expected_cache = qkv.clone(), _cache(shape, FP8)
    _two_kernels(expected_qkv, cos, sin, slots, shape, expected_cache, scales)
    assert _same_bytes(fused_qkv, expected_qkv)
    assert _same_bytes(fused_cache, expected_cache)


def test_fused_takes_int32_slots_and_a_separate_qk():
    """Qwen3's q/k norm hands over qk as a new tensor, apart from v; slots may be int32."""
    shape = (4, 6, 2, 16, 4, 2)
    qkv, cos, sin, slots = _step(shape, torch.bfloat16, seed=2)
    qk, value = (view.clone() for view in _views(qkv, shape))
    cache = _cache(shape, torch.bfloat16)
    rotary_kv_write_(qk, value, cos, sin, cache, slots.int())
    expected_qkv, expected_cache = qkv.clone(), _cache(shape, torch.bfloat16)
    _two_kernels(expected_qkv, cos, sin, slots, shape, expected_cache, ())
    assert _same_bytes(qk, _views(expected_qkv, shape)[0])
    assert _same_bytes(cache, expected_cache)


def test_fused_rejects_bad_arguments():
    shape = (2, 4, 2, 8, 4, 2)
    qkv, cos, sin, slots = _step(shape, torch.float32)
    qk, value = _views(qkv, shape)
    cache = _cache(shape, torch.float32)
    with pytest.raises(KernelArgumentError, match="no q heads"):
        rotary_kv_write_(qk[:, 4:], value, cos, sin, cache, slots)
    with pytest.raises(KernelArgumentError, match="cos must be"):
        rotary_kv_write_(qk, value, cos[:1], sin, cache, slots)
    with pytest.raises(KernelArgumentError, match="not qk's"):
        rotary_kv_write_(qk, value, cos.double(), sin, cache, slots)
    with pytest.raises(KernelArgumentError, match="slot_mapping"):
        rotary_kv_write_(qk, value, cos, sin, cache, slots[:1])
    with pytest.raises(KernelArgumentError, match="k_scale"):
        rotary_kv_write_(qk, value, cos, sin, _cache(shape, FP8), slots)
