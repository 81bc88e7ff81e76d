"""Parity of our Qwen2-VL (loader, vision tower, decoder over the paged cache, M-RoPE)
with the transformers implementation, on a tiny random checkpoint built here."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from engine.attention.base import AttentionMetadata  # noqa: E402
from engine.attention.torch_backend import TorchAttentionBackend  # noqa: E402
from engine.models.loader import load_model  # noqa: E402
from engine.models.mrope import decode_positions, mrope_positions  # noqa: E402

IMAGE, VIDEO, VSTART, VEND = 250, 251, 252, 253
PATCH_DIM = 3 * 2 * 4 * 4  # C * T_patch * P * P
ATOL = 1e-4


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    config = transformers.Qwen2VLConfig(
        text_config=dict(
            vocab_size=256,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=512,
            rope_parameters={
                "rope_type": "default",
                "mrope_section": [2, 3, 3],
                "rope_theta": 10000.0,
            },
            bos_token_id=0,
            eos_token_id=1,
        ),
        vision_config=dict(
            depth=2,
            embed_dim=32,
            hidden_size=64,
            num_heads=2,
            mlp_ratio=2,
            patch_size=4,
            temporal_patch_size=2,
            spatial_merge_size=2,
            in_channels=3,
        ),
        image_token_id=IMAGE,
        video_token_id=VIDEO,
        vision_start_token_id=VSTART,
        vision_end_token_id=VEND,
    )
    torch.manual_seed(0)
    hf_model = transformers.Qwen2VLForConditionalGeneration(config).eval()
    _spread_weights(hf_model)
    path = tmp_path_factory.mktemp("tiny_qwen2_vl")
    hf_model.save_pretrained(path)
    return str(path), hf_model


def _spread_weights(hf_model):
    """The default init (std 0.02) makes positions barely matter; use unit-gain weights so a
    wrong rotary, mask or position shows up far above the tolerance."""
    with torch.no_grad():
        for name, param in hf_model.named_parameters():
            if param.dim() >= 2:
                param.normal_(0.0, param[0].numel() ** -0.5)
            elif name.endswith("weight") and ("norm" in name or "ln_q" in name):
                param.normal_(1.0, 0.1)
            else:
                param.normal_(0.0, 0.1)


@pytest.fixture(scope="module")
def model(checkpoint):
    path, _ = checkpoint
    return load_model(
        path, dtype=torch.float32, device=torch.device("cpu"), attention=TorchAttentionBackend()
    )


def _text(generator, n):
    return torch.randint(0, 250, (n,), generator=generator).tolist()


def _image_prompt(generator, grids):
    """Text, then per image <start> placeholders <end> text. Returns (ids, media spans)."""
    ids, media = _text(generator, 5), []
    for t, h, w in grids:
        ids.append(VSTART)
        n = t * h * w // 4
        media.append((len(ids), n, (t, h, w), "image"))
        ids += [IMAGE] * n + [VEND] + _text(generator, 3)
    return ids, media


def _hf_logits(hf_model, ids, pixel_values=None, grid_thw=None):
    input_ids = torch.tensor([ids])
    kwargs = {}
    if pixel_values is not None:
        kwargs = dict(
            pixel_values=pixel_values,
            image_grid_thw=grid_thw,
            mm_token_type_ids=(input_ids == IMAGE).int(),
        )
    with torch.no_grad():
        return hf_model(input_ids=input_ids, **kwargs).logits[0]  # [L, V]


class PagedRunner:
    """A minimal model runner: runs scheduled chunks of several sequences over a paged cache."""

    def __init__(self, model, block_size=4, num_blocks=64):
        cfg = model.config
        self.model, self.block_size = model, block_size
        shape = (num_blocks, 2, block_size, cfg.num_key_value_heads, cfg.head_dim)
        self.kv_caches = [torch.zeros(shape) for _ in range(cfg.num_hidden_layers)]
        self.free = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(1)).tolist()
        self.seqs = []

    def add(self, ids, positions, mm_embeds=None):
        num_blocks = -(-len(ids) // self.block_size)
        blocks = [self.free.pop() for _ in range(num_blocks)]
        mask = torch.tensor(ids) == IMAGE
        self.seqs.append(
            dict(ids=ids, pos=positions, mm=mm_embeds, mask=mask, blocks=blocks, done=0, logits=[])
        )

    def step(self, plan):  # plan: list of (seq index, number of tokens)
        ids, pos, slots, mm_rows, mm_mask, qlens, slens, tables = [], [], [], [], [], [], [], []
        for i, n in plan:
            s = self.seqs[i]
            lo, hi = s["done"], s["done"] + n
            ids += s["ids"][lo:hi]
            pos.append(s["pos"][:, lo:hi])
            slots += [
                s["blocks"][j // self.block_size] * self.block_size + j % self.block_size
                for j in range(lo, hi)
            ]
            mm_mask.append(s["mask"][lo:hi])
            if s["mm"] is not None:
                mm_rows.append(s["mm"][int(s["mask"][:lo].sum()) : int(s["mask"][:hi].sum())])
            qlens.append(n)
            slens.append(hi)
            tables.append(s["blocks"])
            s["done"] = hi
        width = max(len(t) for t in tables)
        meta = AttentionMetadata(
            num_seqs=len(plan),
            query_lens=qlens,
            seq_lens=slens,
            query_start_loc=torch.tensor([0] + qlens, dtype=torch.int32).cumsum(
                0, dtype=torch.int32
            ),
            seq_lens_tensor=torch.tensor(slens, dtype=torch.int32),
            block_tables=torch.tensor(
                [t + [0] * (width - len(t)) for t in tables], dtype=torch.int32
            ),
            slot_mapping=torch.tensor(slots, dtype=torch.long),
            is_decode_only=all(q == 1 for q in qlens),
        )
        mm = torch.cat(mm_rows) if mm_rows else None
        with torch.no_grad():
            hidden = self.model(
                torch.tensor(ids),
                torch.cat(pos, dim=1),
                self.kv_caches,
                meta,
                multimodal_embeds=mm,
                multimodal_rows=torch.cat(mm_mask).nonzero()[:, 0],
            )
            logits = self.model.compute_logits(hidden)
        start = 0
        for i, n in plan:
            self.seqs[i]["logits"].append(logits[start : start + n])
            start += n

    def logits(self, i):
        return torch.cat(self.seqs[i]["logits"])


def test_text_prefill_matches_hf(checkpoint, model):
    _, hf_model = checkpoint
    ids = _text(torch.Generator().manual_seed(2), 11)
    positions, delta = mrope_positions(ids, [], spatial_merge_size=2)
    assert delta == 0
    runner = PagedRunner(model)
    runner.add(ids, positions)
    runner.step([(0, len(ids))])
    torch.testing.assert_close(runner.logits(0), _hf_logits(hf_model, ids), atol=ATOL, rtol=0)


def test_two_image_prefill_matches_hf(checkpoint, model):
    _, hf_model = checkpoint
    gen = torch.Generator().manual_seed(3)
    grids = [(1, 4, 6), (1, 8, 4)]
    ids, media = _image_prompt(gen, grids)
    grid_thw = torch.tensor(grids)
    pixels = torch.randn(int(grid_thw.prod(-1).sum()), PATCH_DIM, generator=gen)
    positions, delta = mrope_positions(ids, media, spatial_merge_size=2)
    hf_positions, hf_delta = hf_model.model.get_rope_index(
        torch.tensor([ids]),
        mm_token_type_ids=(torch.tensor([ids]) == IMAGE).int(),
        image_grid_thw=grid_thw,
    )
    assert torch.equal(positions, hf_positions[:, 0]) and delta == int(hf_delta)
    with torch.no_grad():
        mm = model.encode_images(pixels, grid_thw)
    assert mm.shape == (sum(m[1] for m in media), 64)
    runner = PagedRunner(model)
    runner.add(ids, positions, mm)
    runner.step([(0, len(ids))])
    expected = _hf_logits(hf_model, ids, pixels, grid_thw)
    torch.testing.assert_close(runner.logits(0), expected, atol=ATOL, rtol=0)


def test_chunked_prefill_and_batched_decode_match_hf(checkpoint, model):
    _, hf_model = checkpoint
    gen = torch.Generator().manual_seed(4)
    grids = [(1, 4, 6), (1, 4, 4)]
    prompt_a, media = _image_prompt(gen, grids)  # 25 tokens; images at 6..11 and 17..20
    grid_thw = torch.tensor(grids)
    pixels = torch.randn(int(grid_thw.prod(-1).sum()), PATCH_DIM, generator=gen)
    prompt_b = _text(gen, 13)
    decode_a, decode_b = _text(gen, 3), _text(gen, 5)

    pos_a, delta_a = mrope_positions(prompt_a, media, spatial_merge_size=2)
    assert delta_a < 0
    pos_a = torch.cat([pos_a, decode_positions(len(prompt_a), len(decode_a), delta_a)], dim=1)
    pos_b, delta_b = mrope_positions(prompt_b, [], spatial_merge_size=2)
    pos_b = torch.cat([pos_b, decode_positions(len(prompt_b), len(decode_b), delta_b)], dim=1)
    with torch.no_grad():
        mm = model.encode_images(pixels, grid_thw)

    runner = PagedRunner(model, block_size=4)
    runner.add(prompt_a + decode_a, pos_a, mm)
    runner.add(prompt_b + decode_b, pos_b)
    runner.step([(0, 8), (1, 5)])  # A's chunk ends inside image 1
    runner.step([(0, 11), (1, 8)])  # ends inside image 2; B's prompt complete
    runner.step([(0, 6), (1, 1)])  # A's prompt complete, B decodes (mixed step)
    for _ in range(3):
        runner.step([(0, 1), (1, 1)])  # all-decode fast path
    runner.step([(1, 1)])

    full_a = _hf_logits(hf_model, prompt_a + decode_a, pixels, grid_thw)
    full_b = _hf_logits(hf_model, prompt_b + decode_b)
    torch.testing.assert_close(runner.logits(0), full_a, atol=ATOL, rtol=0)
    torch.testing.assert_close(runner.logits(1), full_b, atol=ATOL, rtol=0)


def test_encode_images_batched_equals_single_and_hf(checkpoint, model):
    _, hf_model = checkpoint
    gen = torch.Generator().manual_seed(5)
    grids = [(1, 4, 6), (2, 4, 4), (1, 6, 4)]  # two images and a 2-frame video
    items = [torch.randn(t * h * w, PATCH_DIM, generator=gen) for t, h, w in grids]
    grid_thw = torch.tensor(grids)
    with torch.no_grad():
        batched = model.encode_images(torch.cat(items), grid_thw)
        alone = torch.cat(
            [model.encode_images(x, grid_thw[i : i + 1]) for i, x in enumerate(items)]
        )
        hf = hf_model.model.visual(torch.cat(items), grid_thw=grid_thw).pooler_output
    assert batched.shape == (6 + 8 + 6, 64)
    torch.testing.assert_close(batched, alone, atol=1e-5, rtol=0)
    torch.testing.assert_close(batched, hf, atol=ATOL, rtol=0)


def test_mrope_positions_match_hf_for_video(checkpoint):
    _, hf_model = checkpoint
    ids = [5, 6, VSTART] + [VIDEO] * 12 + [VEND, 7, VSTART] + [IMAGE] * 6 + [VEND, 8]
    media = [(3, 12, (3, 4, 4), "video"), (18, 6, (1, 4, 6), "image")]
    positions, delta = mrope_positions(ids, media, spatial_merge_size=2)
    input_ids = torch.tensor([ids])
    types = (input_ids == IMAGE).int() + 2 * (input_ids == VIDEO).int()
    hf_positions, hf_delta = hf_model.model.get_rope_index(
        input_ids,
        mm_token_type_ids=types,
        image_grid_thw=torch.tensor([[1, 4, 6]]),
        video_grid_thw=torch.tensor([[3, 4, 4]]),
    )
    assert torch.equal(positions, hf_positions[:, 0])
    assert delta == int(hf_delta)


def test_bfloat16_runs_close_to_float32(checkpoint, model):
    path, _ = checkpoint
    bf16 = load_model(
        path, dtype=torch.bfloat16, device=torch.device("cpu"), attention=TorchAttentionBackend()
    )
    gen = torch.Generator().manual_seed(6)
    ids, media = _image_prompt(gen, [(1, 4, 4)])
    pixels = torch.randn(16, PATCH_DIM, generator=gen)
    positions, _ = mrope_positions(ids, media, spatial_merge_size=2)
    results = []
    for m in (model, bf16):
        with torch.no_grad():
            mm = m.encode_images(pixels, torch.tensor([[1, 4, 4]]))
        assert mm.dtype == next(m.parameters()).dtype
        runner = PagedRunner(m)
        runner.kv_caches = [c.to(next(m.parameters()).dtype) for c in runner.kv_caches]
        runner.add(ids, positions, mm)
        runner.step([(0, len(ids))])
        results.append(runner.logits(0))
    assert results[1].dtype == torch.bfloat16  # the sampler casts what it computes with
    torch.testing.assert_close(results[1].float(), results[0], atol=0.15, rtol=0.05)
