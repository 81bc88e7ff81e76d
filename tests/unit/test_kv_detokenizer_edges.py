"""KV-cache eviction order, media spans at a prefix hit's end, duplicate blocks; the
detokenizer's empty stop string and added tokens' bytes (mutation testing found each
untested)."""

from __future__ import annotations

from engine.detokenizer import StopChecker
from engine.kv_cache_manager import KVCacheManager
from engine.protocol import SamplingParams
from engine.request import Request


def make_request(request_id, tokens):
    return Request(request_id, tokens, SamplingParams(max_tokens=4))


def test_a_freed_requests_tail_blocks_are_evicted_before_its_head():
    # evicting a prefix's first block makes every later block unreachable; the tail
    # goes first, so a repeat of the prompt still hits its head.
    kv = KVCacheManager(3, 4)
    first = make_request("a", list(range(13)))  # 3 full blocks + 1 token
    assert kv.allocate_slots(first, 12)
    first.num_computed_tokens = 12
    kv.free(first)
    other = make_request("b", [99] * 4)
    assert kv.allocate_slots(other, 4)  # takes one free block: a's tail
    again = make_request("c", list(range(13)))
    assert kv.get_computed_blocks(again)[1] == 8


def test_an_empty_stop_string_is_ignored():
    # "" would match at once and end every answer with no text
    checker = StopChecker(["", "xyz"])
    result = checker.feed("hello")
    assert (result.text, result.is_stopped) == ("hello", False)


def test_a_prefix_hit_may_end_exactly_where_a_media_span_ends():
    # the limit at a span's end splits nothing: the whole span is a hit
    from engine.request import MediaItem

    def with_image(request_id):
        media = [MediaItem("image", "img", 4, 8, (1, 2, 16))]
        return Request(request_id, list(range(13)), SamplingParams(max_tokens=4), media=media)

    kv = KVCacheManager(16, 4)
    first = with_image("a")
    assert kv.allocate_slots(first, 13)
    assert kv.get_computed_blocks(with_image("b"))[1] == 12


def test_a_duplicate_block_leaves_the_first_copy_cached():
    # "b" computed the same blocks as "a" (no lookup); reusing b's blocks for other
    # text must not lose a's entries
    kv = KVCacheManager(6, 4)
    a, b = make_request("a", list(range(9))), make_request("b", list(range(9)))
    assert kv.allocate_slots(a, 8)
    a_blocks = list(a.block_ids)
    assert kv.allocate_slots(b, 8)
    b.num_computed_tokens = 8
    kv.free(b)
    assert kv.allocate_slots(make_request("c", [77] * 8), 8)  # two of b's freed blocks
    blocks, num_cached = kv.get_computed_blocks(make_request("d", list(range(9))))
    assert (blocks, num_cached) == (a_blocks, 8)


def test_an_added_tokens_bytes_are_its_utf8_in_a_byte_level_vocabulary():
    # an added token is stored as plain text, not in GPT-2's byte alphabet: "é"
    # there is byte 0xE9, in UTF-8 it is C3 A9
    from engine.detokenizer import token_bytes
    from engine.tiny_model import SIZES, train_tokenizer

    tokenizer = train_tokenizer(SIZES["tiny"].bpe_vocab_size)
    tokenizer.add_tokens(["<é>"])
    token_id = tokenizer.token_to_id("<é>")
    assert token_bytes(tokenizer, token_id) == "<é>".encode()


def test_a_kv_cache_of_no_blocks_is_refused():
    # 0 blocks would divide by zero in `usage` and refuse every request
    import pytest

    with pytest.raises(ValueError):
        KVCacheManager(0, 16)
