"""KVCacheManager: block accounting, all-or-nothing allocation, prefix caching."""

from engine.kv_cache_manager import KVCacheManager
from engine.protocol import SamplingParams
from engine.request import MediaItem, Request


def make_request(request_id: str, tokens: list[int], media=None, cache_salt=None) -> Request:
    return Request(
        request_id, tokens, SamplingParams(max_tokens=4), media=media, cache_salt=cache_salt
    )


def test_allocate_and_free_counts_blocks():
    kv = KVCacheManager(8, 4, enable_prefix_caching=False)
    request = make_request("a", list(range(10)))
    assert kv.allocate_slots(request, 10)
    assert len(request.block_ids) == 3 and len(set(request.block_ids)) == 3
    assert kv.num_free_blocks == 5
    assert kv.usage == 3 / 8
    request.num_computed_tokens = 10
    assert kv.allocate_slots(request, 2)  # 12 tokens still fit 3 blocks
    assert len(request.block_ids) == 3
    assert kv.allocate_slots(request, 3)  # 13..15 -> a 4th block
    assert len(request.block_ids) == 4
    kv.free(request)
    assert request.block_ids == [] and kv.num_free_blocks == 8 and kv.usage == 0.0


def test_allocation_is_all_or_nothing():
    kv = KVCacheManager(4, 4, enable_prefix_caching=False)
    first = make_request("a", list(range(12)))
    assert kv.allocate_slots(first, 12)
    second = make_request("b", list(range(8)))
    assert not kv.allocate_slots(second, 8)
    assert second.block_ids == [] and kv.num_free_blocks == 1


def test_prefix_hit_reuses_full_blocks_but_not_last_token():
    kv = KVCacheManager(16, 4)
    tokens = list(range(100, 112))  # exactly 3 blocks
    first = make_request("a", tokens)
    assert kv.get_computed_blocks(first) == ([], 0)
    assert kv.allocate_slots(first, 12)
    first_blocks = list(first.block_ids)
    kv.free(first)
    second = make_request("b", tokens)
    blocks, num_cached = kv.get_computed_blocks(second)
    assert num_cached == 8  # the last block holds the last token: recomputed
    assert blocks == first_blocks[:2]
    assert kv.allocate_slots(second, 4, blocks)
    assert second.block_ids[:2] == blocks and len(second.block_ids) == 3
    third = make_request("c", tokens[:8] + [1, 2, 3, 4, 5])
    blocks3, cached3 = kv.get_computed_blocks(third)
    assert cached3 == 8 and blocks3 == blocks
    assert kv.allocate_slots(third, 5, blocks3)
    assert kv.blocks[blocks[0]].ref_count == 2


def test_different_media_same_tokens_do_not_share():
    kv = KVCacheManager(16, 4)
    tokens = [7] * 12
    image_a = MediaItem("image", "hash-a", 0, 4, (1, 4, 4))
    image_b = MediaItem("image", "hash-b", 0, 4, (1, 4, 4))
    first = make_request("a", tokens, [image_a])
    kv.get_computed_blocks(first)
    assert kv.allocate_slots(first, 12)
    other = make_request("b", tokens, [image_b])
    assert kv.get_computed_blocks(other) == ([], 0)
    same = make_request("c", tokens, [MediaItem("image", "hash-a", 0, 4, (1, 4, 4))])
    assert kv.get_computed_blocks(same)[1] == 8


def test_only_requests_with_the_same_cache_salt_share():
    kv = KVCacheManager(32, 4)
    tokens = list(range(200, 212))
    first = make_request("a", tokens, cache_salt="tenant-1")
    kv.get_computed_blocks(first)
    assert kv.allocate_slots(first, 12)
    for request_id, salt in [("b", "tenant-2"), ("c", None), ("d", "")]:
        other = make_request(request_id, tokens, cache_salt=salt)
        assert kv.get_computed_blocks(other) == ([], 0), salt
    same = make_request("e", tokens, cache_salt="tenant-1")
    assert kv.get_computed_blocks(same) == (first.block_ids[:2], 8)
    unsalted = make_request("f", tokens)
    kv.get_computed_blocks(unsalted)
    assert kv.allocate_slots(unsalted, 12)
    assert kv.get_computed_blocks(make_request("g", tokens))[1] == 8


def test_a_video_at_another_time_spacing_does_not_share():
    # Qwen2.5-VL: the same frames at another second_per_grid_t sit at other positions.
    kv = KVCacheManager(16, 4)
    tokens = [7] * 12

    def video(seconds: float) -> MediaItem:
        return MediaItem("video", "hash-v", 0, 8, (2, 4, 4), second_per_grid_t=seconds)

    first = make_request("a", tokens, [video(1.25)])
    kv.get_computed_blocks(first)
    assert kv.allocate_slots(first, 12)
    assert kv.get_computed_blocks(make_request("b", tokens, [video(1.0)])) == ([], 0)
    assert kv.get_computed_blocks(make_request("c", tokens, [video(1.25)]))[1] == 8


def test_prefix_hit_never_splits_a_media_span():
    kv = KVCacheManager(16, 4)
    tokens = list(range(20))
    image = MediaItem("image", "h", 6, 8, (1, 4, 8))  # span [6, 14)
    first = make_request("a", tokens, [image])
    assert kv.allocate_slots(first, 20)
    second = make_request("b", tokens[:10] + [99], [MediaItem("image", "h", 6, 8, (1, 4, 8))])
    # 10 of 11 tokens could hit 2 blocks (8 tokens) but 8 is inside [6, 14): cut to 4.
    assert kv.get_computed_blocks(second)[1] == 4


def test_evicted_block_loses_its_hash():
    kv = KVCacheManager(3, 4)
    first = make_request("a", list(range(12)))
    kv.get_computed_blocks(first)
    assert kv.allocate_slots(first, 12)
    kv.free(first)
    other = make_request("b", list(range(50, 62)))
    assert kv.allocate_slots(other, 12)  # reuses (evicts) all three blocks
    again = make_request("c", list(range(12)))
    assert kv.get_computed_blocks(again) == ([], 0)


def test_free_without_keep_cached_drops_hashes():
    kv = KVCacheManager(8, 4)
    first = make_request("a", list(range(12)))
    assert kv.allocate_slots(first, 12)
    kv.free(first, keep_cached=False)
    assert kv.get_computed_blocks(make_request("b", list(range(12)))) == ([], 0)


def test_decode_steps_register_only_new_full_blocks():
    # Each decode step allocates; registration must look only at blocks that filled since
    # the last one (it used to walk every block of the request, O(context) per step).
    kv = KVCacheManager(64, 4)
    request = make_request("a", list(range(100, 140)))  # 10 full blocks
    assert kv.allocate_slots(request, 40)
    request.num_computed_tokens = 40
    assert request.num_registered_blocks == 10
    assert all(kv.blocks[b].block_hash is not None for b in request.block_ids)
    for step in range(5):  # decode: one token a step; the 11th block fills at token 44
        request.output_token_ids.append(7 + step)
        assert kv.allocate_slots(request, 1)
        request.num_computed_tokens += 1
        assert request.num_registered_blocks == (11 if request.num_computed_tokens >= 44 else 10)
    assert kv.blocks[request.block_ids[10]].block_hash == request.block_hashes[10]
    kv.free(request)
    assert request.num_registered_blocks == 0
    again = make_request("b", list(range(100, 140)) + [7, 8, 9, 10, 11])
    blocks, num_cached = kv.get_computed_blocks(again)
    assert num_cached == 44  # the block filled while decoding is in the cache too
    assert kv.allocate_slots(again, 1, blocks)
    assert again.num_registered_blocks == 11


def test_a_block_filled_on_an_in_flight_token_is_registered_by_the_next_allocation():
    # Overlap scheduling allocates index 7 while its token is still being sampled: block 1
    # is full but cannot be hashed yet. The next decode fits the blocks it holds (the fast
    # path), yet must still register block 1.
    kv = KVCacheManager(16, 4)
    request = make_request("a", list(range(100, 107)))  # 7 tokens: blocks 0 (full) and 1
    assert kv.allocate_slots(request, 7)
    request.num_computed_tokens = 7
    assert request.num_registered_blocks == 1
    assert kv.allocate_slots(request, 1)  # index 7: its token is in flight
    request.num_computed_tokens = 8
    assert request.num_registered_blocks == 1 and len(request.block_ids) == 2
    request.output_token_ids.append(9)  # the token arrives
    assert kv.allocate_slots(request, 1)  # index 8 takes block 2
    request.num_computed_tokens = 9
    assert request.num_registered_blocks == 2 and len(request.block_ids) == 3
    assert kv.blocks[request.block_ids[1]].block_hash == request.block_hashes[1]
    request.output_token_ids.append(10)
    assert kv.allocate_slots(request, 1)  # index 9 fits block 2, nothing new to register
    assert request.num_registered_blocks == 2 and len(request.block_ids) == 3


def test_the_light_engine_modules_import_without_torch():
    """The cache accounting is pure Python, and so are the modules engine/__init__.py calls
    light: importing them must not load torch (engine.request, which the manager names in
    annotations only, imports it)."""
    import subprocess
    import sys

    modules = ["engine.kv_cache_manager", "engine.protocol", "engine.errors", "engine.config"]
    code = f"import sys; import {', '.join(modules)}; print('torch' in sys.modules)"
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=True).stdout.strip()  # fmt: skip
    assert loaded == "False"
