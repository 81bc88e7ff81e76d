"""Incremental detokenisation (multi-byte UTF-8) and stop strings, on the tiny tokenizer."""

from __future__ import annotations

import pytest

from engine.detokenizer import (
    IncrementalDetokenizer,
    SequenceDetokenizer,
    StopChecker,
    token_bytes,
)
from engine.tiny_model import SIZES, train_tokenizer

TEXTS = [
    "Hello world, the cat sat.",
    "héllo wörld ñ",
    "中文字符 and emoji 🎉🚀 mixed",
    "tab\tnew\nline  double  space",
]


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer(SIZES["tiny"].bpe_vocab_size)


@pytest.mark.parametrize("text", TEXTS)
def test_one_token_at_a_time_rebuilds_text_without_replacement_chars(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    detok = IncrementalDetokenizer(tokenizer)
    deltas = [detok.step([token_id]) for token_id in ids]
    deltas.append(detok.finish())
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == text


def test_emoji_spans_several_tokens_and_is_held_back(tokenizer):
    ids = tokenizer.encode("🎉", add_special_tokens=False).ids
    assert len(ids) > 1  # byte-level pieces: the test would be vacuous otherwise
    detok = IncrementalDetokenizer(tokenizer)
    assert [detok.step([i]) for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert detok.step([ids[-1]]) == "🎉"


def test_prompt_context_does_not_leak_into_output(tokenizer):
    prompt = tokenizer.encode("The cat", add_special_tokens=False).ids
    out = tokenizer.encode(" sat on the mat", add_special_tokens=False).ids
    detok = IncrementalDetokenizer(tokenizer, prompt)
    text = "".join(detok.step([i]) for i in out) + detok.finish()
    assert text == " sat on the mat"


def test_special_tokens_skipped(tokenizer):
    im_end = tokenizer.token_to_id("<|im_end|>")
    ids = tokenizer.encode("Hi there", add_special_tokens=False).ids + [im_end]
    detok = IncrementalDetokenizer(tokenizer)
    assert "".join(detok.step([i]) for i in ids) + detok.finish() == "Hi there"


def test_incomplete_sequence_flushed_at_finish(tokenizer):
    ids = tokenizer.encode("🎉", add_special_tokens=False).ids
    detok = IncrementalDetokenizer(tokenizer)
    assert detok.step(ids[:1]) == ""
    assert detok.finish() == tokenizer.decode(ids[:1])


def test_stop_checker_holds_back_partial_match():
    checker = StopChecker(["STOP"])
    assert checker.feed("abc S").text == "abc "
    assert checker.feed("T").text == ""
    result = checker.feed("OP and more")
    assert result.is_stopped and result.text == ""


def test_stop_checker_releases_false_alarm():
    checker = StopChecker(["STOP"])
    assert checker.feed("ST").text == ""
    assert checker.feed("ART").text == "START"
    assert checker.flush() == ""


def test_stop_checker_earliest_of_several():
    checker = StopChecker(["world", "lo"])
    result = checker.feed("hello world")
    assert result.is_stopped and result.text == "hel"


def test_stop_checker_reports_the_stop_and_can_keep_it():
    kept = StopChecker(["world", "lo"], include_stop=True)
    result = kept.feed("hello world")
    assert result.is_stopped and result.text == "hello" and kept.matched == "lo"
    cut = StopChecker(["ab", "abc"])
    assert cut.feed("xabcd").text == "x" and cut.matched == "ab"  # same start: the shorter
    assert StopChecker(["q"]).matched is None


def test_stop_checker_keeps_a_stop_split_across_feeds():
    checker = StopChecker(["STOP"], include_stop=True)
    assert checker.feed("go ST").text == "go "
    result = checker.feed("OP now")
    assert result.is_stopped and result.text == "STOP" and checker.matched == "STOP"


def test_stop_checker_flush_releases_held_text():
    checker = StopChecker(["xyz"])
    assert checker.feed("abx").text == "ab"
    assert checker.flush() == "x"


@pytest.mark.parametrize("stop", ["sat on", "t o", "mat"])
def test_sequence_stop_split_across_tokens(tokenizer, stop):
    text = "The cat sat on the mat today"
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    seq = SequenceDetokenizer(tokenizer, stop=[stop])
    emitted = []
    for token_id in ids:
        emitted.append(seq.step([token_id]))
        # no prefix of the stop string longer than one char is ever visible at the end
        assert stop not in "".join(emitted)
        if seq.is_stopped:
            break
    emitted.append(seq.finish())
    assert seq.is_stopped
    assert "".join(emitted) == text[: text.index(stop)] == seq.text


@pytest.mark.parametrize("stop", ["sat on", "t o", "mat"])
def test_sequence_keeps_a_stop_split_across_tokens(tokenizer, stop):
    text = "The cat sat on the mat today"
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    seq = SequenceDetokenizer(tokenizer, stop=[stop], include_stop=True)
    emitted = "".join(seq.step([token_id]) for token_id in ids) + seq.finish()
    assert emitted == text[: text.index(stop) + len(stop)] == seq.text
    assert seq.matched_stop == stop


def test_stop_strings_wait_for_min_tokens(tokenizer):
    text = "The cat sat on the mat today, the cat sat"
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    first = tokenizer.encode("The cat sat", add_special_tokens=False).ids
    seq = SequenceDetokenizer(tokenizer, stop=["cat"], min_tokens=len(first))
    emitted = [seq.step([token_id]) for token_id in ids]
    # The first "cat" lies in the first min_tokens tokens: unchecked; the second stops.
    assert seq.is_stopped
    assert "".join(emitted) == text[: text.rindex("cat")] == seq.text


@pytest.mark.parametrize("stop, expected", [("t s", "The ca"), ("The", None), ("cat", "The cat sat on the mat today, the ")])
def test_a_stop_string_may_begin_in_the_min_tokens_and_end_after_them(tokenizer, stop, expected):
    """As vLLM's: a stop string must end after the first min_tokens tokens, and may begin
    in them ("t s" across "cat" and " sat"); one wholly in them is not matched. The text
    of those tokens that might begin a stop string was not held back, so a stop across
    the boundary was never found."""
    text = "The cat sat on the mat today, the cat sat"
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    min_tokens = len(tokenizer.encode("The cat", add_special_tokens=False).ids)
    seq = SequenceDetokenizer(tokenizer, stop=[stop], min_tokens=min_tokens)
    emitted = "".join(seq.step([token_id]) for token_id in ids)
    emitted += seq.finish()
    assert seq.is_stopped == (expected is not None)
    assert emitted == seq.text == (text if expected is None else expected)


def test_min_tokens_hold_for_text_flushed_at_the_end():
    """The last of the min_tokens tokens ends inside a character (one token of "é" and the
    lead byte of "中", as real Qwen vocabularies have): its text, held back until the end,
    went to the stop checker without the min_tokens gate, and "é" stopped an answer whose
    every token was within min_tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {piece: i for i, piece in enumerate([*alphabet, "Ã©", "Ã©ä"])}
    tokenizer = Tokenizer(models.BPE(vocab, [("Ã", "©"), ("Ã©", "ä")]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    ids = [vocab["a"], vocab["Ã©ä"]]
    seq = SequenceDetokenizer(tokenizer, stop=["é"], min_tokens=2)
    text = "".join(seq.step([token_id]) for token_id in ids) + seq.finish()
    assert not seq.is_stopped and seq.matched_stop is None
    assert text == seq.text == tokenizer.decode(ids) == "aé\ufffd"


def test_a_stop_string_the_flushed_tail_completes_ends_the_answer_as_stop():
    """The length limit cut the answer inside a character, and the stop string ended with
    that character's U+FFFD: the text was cut at it, but the answer said "length" and no
    stop_reason (fuzz113)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from engine.choices import answer_step
    from engine.protocol import FinishReason, RequestOutput, SamplingParams

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {piece: i for i, piece in enumerate([*alphabet, "Ã©", "Ã©ä"])}
    tokenizer = Tokenizer(models.BPE(vocab, [("Ã", "©"), ("Ã©", "ä")]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    output = RequestOutput(request_id="r", new_token_ids=[vocab["a"], vocab["Ã©ä"]],
                           finish_reason=FinishReason.LENGTH)  # fmt: skip
    for include in (False, True):
        seq = SequenceDetokenizer(tokenizer, stop=["é\ufffd"], include_stop=include)
        step = answer_step(seq, output, SamplingParams(max_tokens=2))
        assert (step.finish_reason, step.stop_reason) == ("stop", "é\ufffd")
        assert step.text == ("aé\ufffd" if include else "a") and step.num_tokens == 2


def test_token_bytes(tokenizer):
    ids = tokenizer.encode("é🎉 x", add_special_tokens=False).ids
    assert b"".join(token_bytes(tokenizer, i) for i in ids) == "é🎉 x".encode()
    im_end = tokenizer.token_to_id("<|im_end|>")
    assert token_bytes(tokenizer, im_end) == b"<|im_end|>"


def sentencepiece_tokenizer():
    """A Llama 2 / Mistral style vocabulary: "▁" for a space, "<0xNN>" byte fallback."""
    from tokenizers import Tokenizer, decoders, models

    pieces = ["<unk>", *(f"<0x{b:02X}>" for b in range(256)), "\u2581", "é", "\u2581é", "Ā"]
    vocab = {piece: i for i, piece in enumerate(pieces)}
    tokenizer = Tokenizer(models.BPE(vocab, [], unk_token="<unk>", byte_fallback=True))
    tokenizer.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                           decoders.Fuse(), decoders.Strip(" ", 1, 0)])  # fmt: skip
    return tokenizer, vocab


def test_token_bytes_of_a_sentencepiece_vocabulary():
    """Its pieces were read as GPT-2's byte alphabet: "é" came out as the byte E9, "Ā" as
    00, "▁é" kept its "▁", and "<0x9F>" was the six bytes of its name."""
    tokenizer, vocab = sentencepiece_tokenizer()
    expected = {"é": "é".encode(), "Ā": "Ā".encode(), "\u2581é": b" \xc3\xa9", "<0x9F>": b"\x9f",
                "\u2581": b" "}  # fmt: skip
    assert {piece: token_bytes(tokenizer, vocab[piece]) for piece in expected} == expected
    ids = [vocab[p] for p in ("é", "\u2581é", "<0xF0>", "<0x9F>", "<0x98>", "<0x80>", "Ā")]
    assert b"".join(token_bytes(tokenizer, i) for i in ids).decode() == tokenizer.decode(ids)


def test_tokens_after_a_stop_string_are_no_part_of_the_answer(tokenizer):
    """Several tokens in one engine output (a merged backlog) and a stop string in the
    middle: the usage and the logprobs counted every one of them, though the text ended
    at the stop (1 in 24 answers of 4 concurrent requests, 2026-11-27)."""
    import asyncio

    from engine.protocol import FinishReason, RequestOutput, SamplingParams, TokenLogprob
    from server.generation import GenerationJob, GenerationTotals, PreparedPrompt, generate_choices

    ids = tokenizer.encode(
        "the cat sat on the mat and then went home", add_special_tokens=False
    ).ids
    stop_at = next(i for i in range(len(ids)) if "mat" in tokenizer.decode(ids[: i + 1]))

    class OneBigOutput:  # the engine's outputs merged into one, as a slow reader gets them
        async def generate(self, request, tensors=(), *, tokens_per_wake=1):
            yield RequestOutput(request_id=request.request_id, new_token_ids=ids,
                                logprobs=[TokenLogprob(t, -0.5, []) for t in ids],
                                finish_reason=FinishReason.LENGTH)  # fmt: skip

        async def abort(self, request_ids):
            pass

    async def run():
        totals = GenerationTotals()
        sampling = SamplingParams(max_tokens=len(ids), logprobs=0)
        job = GenerationJob("r", "m", PreparedPrompt([1, 2]), sampling, n=1, stop=["mat"])
        deltas = [d async for d in generate_choices(OneBigOutput(), tokenizer, job, totals)]
        return deltas, totals

    deltas, totals = asyncio.run(run())
    assert "".join(d.text for d in deltas) == "the cat sat on the "
    assert deltas[-1].finish_reason == "stop" and deltas[-1].stop_reason == "mat"
    assert [t for d in deltas for t in d.token_ids] == ids[: stop_at + 1]
    assert sum(len(d.logprobs) for d in deltas) == stop_at + 1 == totals.num_generated_tokens
    # One token gap after each token the client got but the first: the tokens past the stop
    # string counted gaps too (more gaps than tokens, most of them 0 s).
    assert len(totals.inter_token_seconds) == stop_at
    # Without stop strings every token counts, in one step.
    detokenizer = SequenceDetokenizer(tokenizer)
    assert detokenizer.step_until_stop(ids) == (detokenizer.text, len(ids))


def test_text_offsets_index_the_text_through_multibyte_characters(tokenizer):
    """Each token's text offset is where its text starts in the text; the tokens of one
    character share its offset. They counted each U+FFFD piece as a character and ran past
    the text (0..17 for 10 characters, then the completion restarted at 10)."""
    from server.logprobs import echoed_text_offsets

    text = "héllo 世界 🙂 ok"
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids)  # some token splits a character
    detokenizer = SequenceDetokenizer(tokenizer, track_offsets=True)
    for token_id in ids:  # one by one, as a stream brings them, or all at once: the same
        detokenizer.step_until_stop([token_id])
    offsets = detokenizer.text_offsets
    assert offsets == sorted(offsets) and offsets[0] == 0 and offsets[-1] < len(text)
    for index, offset in enumerate(offsets):  # a prefix cut inside a character: U+FFFD
        assert tokenizer.decode(ids[:index]).rstrip("\ufffd") == text[:offset]
    whole = SequenceDetokenizer(tokenizer, track_offsets=True)
    whole.step_until_stop(ids)
    assert whole.text_offsets == offsets == echoed_text_offsets(tokenizer, ids, text)


def test_a_token_released_with_bytes_that_were_no_character_starts_after_them(tokenizer):
    """Two lone bytes are held back (they might start a character) and come out as U+FFFD
    with the next token's text: that token starts after them, not where they do."""
    lone = tokenizer.encode("é", add_special_tokens=False).ids
    word = tokenizer.encode(" the", add_special_tokens=False).ids
    ids = [lone[1], lone[0], *word]  # a continuation byte, then a lead byte, then a word
    detokenizer = SequenceDetokenizer(tokenizer, track_offsets=True)
    detokenizer.step_until_stop(ids)
    text = detokenizer.text + detokenizer.finish()
    assert text == "\ufffd\ufffd the"
    assert detokenizer.text_offsets[-1] == 2 and text[2:] == " the"


def test_a_stop_string_wholly_inside_the_min_tokens_stays_unmatched_later_too(tokenizer):
    """"b" ends in the min_tokens text; "abcd" kept "abc" held back, and the next feed
    looked at all of it again: "b" stopped the answer there, two tokens later."""
    a, b, c, z = (tokenizer.encode(ch, add_special_tokens=False).ids[0] for ch in "abcz")
    seq = SequenceDetokenizer(tokenizer, stop=["b", "abcd"], min_tokens=2)
    emitted = "".join(seq.step([token_id]) for token_id in (a, b, c, z)) + seq.finish()
    assert not seq.is_stopped and emitted == "abcz"


def test_an_echoed_prompt_the_tokenizer_normalises_keeps_its_own_offsets(tokenizer):
    """NFC makes "e" + U+0301 one character: offsets of the normalised text were one short
    of the echo (the prompt as given) after it."""
    from server.logprobs import echoed_text_offsets

    prompt = "e\u0301 combining"
    ids = tokenizer.encode(prompt).ids
    offsets = echoed_text_offsets(tokenizer, ids, prompt)
    assert offsets[0] == 0 and prompt[offsets[-3] :].startswith(tokenizer.decode(ids[-3:-2]))
    assert offsets == sorted(offsets) and offsets[2] == 2  # " com" right after "e\u0301"


@pytest.mark.parametrize("cut", [1, 2, 3])
def test_a_character_the_prompt_begins_and_the_completion_ends_is_the_completions(tokenizer, cut):
    """A token-id prompt that ends inside a character: the tokens that finish it begin
    the completion's text with the whole character (as vLLM's decode stream gives). It
    was lost: its U+FFFD in the prompt's text was the same length as the character."""
    ids = tokenizer.encode("ok 🎉 yes", add_special_tokens=False).ids
    emoji = tokenizer.encode("🎉", add_special_tokens=False).ids
    assert len(emoji) > cut
    start = next(i for i in range(len(ids)) if ids[i : i + len(emoji)] == emoji)
    prompt, output = ids[: start + cut], ids[start + cut :]
    detok = IncrementalDetokenizer(tokenizer, prompt)
    assert "".join(detok.step([i]) for i in output) + detok.finish() == "🎉 yes"
    unfinished = IncrementalDetokenizer(tokenizer, prompt)  # nothing generated
    assert unfinished.finish() == ""
    offsets = SequenceDetokenizer(tokenizer, prompt, track_offsets=True)
    offsets.step_until_stop(output)
    assert offsets.text == "🎉 yes" and offsets.text_offsets[len(emoji) - cut] == 1


def test_a_prompts_unfinished_character_the_completion_does_not_finish(tokenizer):
    """Its U+FFFD ends the prompt's text (an echo shows it), not the completion's."""
    lead = tokenizer.encode("é", add_special_tokens=False).ids[0]
    prompt = tokenizer.encode("ok", add_special_tokens=False).ids + [lead]
    word = tokenizer.encode(" the", add_special_tokens=False).ids
    detok = SequenceDetokenizer(tokenizer, prompt, track_offsets=True)
    detok.step_until_stop(word)
    assert detok.text + detok.finish() == " the"  # the lead byte's U+FFFD is the prompt's
    assert detok.text_offsets[0] == 0
