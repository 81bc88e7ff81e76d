"""The legacy /v1/completions logprobs name a token whose bytes are not whole UTF-8
characters "bytes:\\xNN...", as OpenAI's legacy API did (server/logprobs.py)."""

from __future__ import annotations

from engine.protocol import TokenLogprob
from engine.tiny_model import SIZES, train_tokenizer
from server.logprobs import chat_logprobs, completion_logprobs


def test_partial_character_tokens_keep_apart_in_top_logprobs():
    """fuzz103: as U+FFFD the three pieces of "中" shared one `top_logprobs` key, so a
    request for 3 alternatives got 1."""
    tokenizer = train_tokenizer(SIZES["tiny"].bpe_vocab_size)
    pieces = tokenizer.encode("中", add_special_tokens=False).ids
    assert len(pieces) == 3  # its three UTF-8 bytes, one token each
    plain = tokenizer.encode("cat", add_special_tokens=False).ids[0]
    top = ((pieces[0], -0.5), (pieces[1], -1.0), (pieces[2], -2.0), (plain, -3.0))
    entries = [TokenLogprob(token_id=pieces[0], logprob=-0.5, top=top)]
    legacy = completion_logprobs(tokenizer, entries, [0])
    expected = [f"bytes:\\x{byte:02x}" for byte in "中".encode()]
    assert legacy.tokens == [expected[0]]
    assert list(legacy.top_logprobs[0]) == [*expected, tokenizer.decode([plain])]
    by_id = completion_logprobs(tokenizer, entries, [0], as_ids=True)
    assert by_id.tokens == [f"token_id:{pieces[0]}"]
    # chat's entries carry `bytes`, and keep OpenAI's text there
    chat = chat_logprobs(tokenizer, entries).content[0]
    assert chat.token == "\ufffd" and chat.bytes == ["中".encode()[0]]
