"""IncrementalDetokenizer on tiny offline-trained tokenizers, and stop-string checking."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from keepwarm.worker.detokenizer import (
    IncrementalDetokenizer,
    check_stop_strings,
    stop_hold_back,
)

CORPUS = ["héllo wörld 你好 🙂", "hello world, hello there", "wörld of 你好 and 🙂🙂",
          "the quick brown fox jumps"] * 10
SPECIALS = ["<s>", "</s>", "<|eot|>"]
# Contains characters outside the corpus ("日本", "🎉"): those stay raw byte tokens, split mid-character.
TEXT = " héllo wörld 你好 🙂 日本🎉 the fox. ünïcödé ✓"


@pytest.fixture(scope="module")
def byte_tok() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok)


@pytest.fixture(scope="module")
def metaspace_tok() -> PreTrainedTokenizerFast:
    # SentencePiece-style: decoding "▁world" on its own drops the space.
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=150, special_tokens=SPECIALS,
                                                        show_progress=False))
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def stream(tok: PreTrainedTokenizerFast, prompt: list[int], output: list[int],
           skip_special_tokens: bool = True) -> tuple[IncrementalDetokenizer, list[str]]:
    detok = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip_special_tokens)
    return detok, [detok.step([t]) for t in output]


def test_byte_level_stream_matches_full_decode(byte_tok: PreTrainedTokenizerFast) -> None:
    prompt = byte_tok.encode("hello wörld", add_special_tokens=False)
    output = byte_tok.encode(TEXT, add_special_tokens=False)
    expected = byte_tok.decode(output, skip_special_tokens=True)
    assert expected == TEXT and "\ufffd" not in expected
    detok, pieces = stream(byte_tok, prompt, output)
    assert "".join(pieces) == expected == detok.output_text
    assert not any("\ufffd" in p for p in pieces)
    # Some characters really were split across tokens and held back for a step.
    assert any(p == "" for p in pieces)
    assert detok.flush() == ""


def test_special_tokens_skipped_or_kept(byte_tok: PreTrainedTokenizerFast) -> None:
    eot = byte_tok.convert_tokens_to_ids("<|eot|>")
    bos = byte_tok.convert_tokens_to_ids("<s>")
    prompt = [bos, *byte_tok.encode("hi", add_special_tokens=False), eot]
    words = byte_tok.encode(" 你好 there", add_special_tokens=False)
    output = [*words[:2], eot, *words[2:], eot]
    for skip in (True, False):
        detok, pieces = stream(byte_tok, prompt, output, skip_special_tokens=skip)
        assert "".join(pieces) == byte_tok.decode(output, skip_special_tokens=skip)
    assert "<|eot|>" not in stream(byte_tok, prompt, output)[0].output_text


def test_multi_token_steps_and_empty_prompt_tail(byte_tok: PreTrainedTokenizerFast) -> None:
    output = byte_tok.encode(TEXT, add_special_tokens=False)
    detok = IncrementalDetokenizer(byte_tok, [byte_tok.convert_tokens_to_ids("<s>")])
    pieces = [detok.step(output[i:i + 3]) for i in range(0, len(output), 3)]
    assert "".join(pieces) == TEXT
    assert detok.step([]) == ""


def test_incomplete_tail_is_held_until_flush(byte_tok: PreTrainedTokenizerFast) -> None:
    emoji = byte_tok.encode("🎉", add_special_tokens=False)
    assert len(emoji) > 1
    output = byte_tok.encode(" ok", add_special_tokens=False) + emoji[:-1]
    detok, pieces = stream(byte_tok, byte_tok.encode("hi", add_special_tokens=False), output)
    assert "".join(pieces) == " ok"
    # The request ended mid-character: flush gives what a full decode shows.
    assert " ok" + detok.flush() == byte_tok.decode(output, skip_special_tokens=True)


def test_leading_space_of_first_output_token(metaspace_tok: PreTrainedTokenizerFast) -> None:
    prompt = metaspace_tok.encode("hello", add_special_tokens=False)
    output = metaspace_tok.encode("hello world there", add_special_tokens=False)[1:]  # "▁world", ...
    assert metaspace_tok.decode(output[:1]) == "world"  # alone, the space is lost
    detok, pieces = stream(metaspace_tok, prompt, output)
    assert pieces[0] == " world"
    assert "".join(pieces) == " world there"


def test_long_generation_trims_ids(byte_tok: PreTrainedTokenizerFast) -> None:
    chunk = byte_tok.encode(TEXT, add_special_tokens=False)
    output = chunk * 40
    detok, pieces = stream(byte_tok, chunk[:2], output)
    assert "".join(pieces) == TEXT * 40
    assert len(detok._ids) < 300


# ---- stop strings ---------------------------------------------------------------------------------------


def test_stop_string_truncation() -> None:
    m = check_stop_strings("Hello world STOP and more", " world STOP and more", ["STOP"])
    assert m is not None and m.stop_str == "STOP" and m.text == "Hello world "
    m = check_stop_strings("Hello world STOP and more", " world STOP and more", ["STOP"],
                           include_stop_str_in_output=True)
    assert m is not None and m.text == "Hello world STOP"
    assert check_stop_strings("Hello world", " world", ["STOP"]) is None
    assert check_stop_strings("Hello", "", ["STOP"]) is None
    assert check_stop_strings("Hello world", " world", []) is None


def test_earliest_stop_wins() -> None:
    m = check_stop_strings("abc END xyz STOP", "abc END xyz STOP", ["STOP", "END"])
    assert m is not None and (m.stop_str, m.text) == ("END", "abc ")
    # Same start: the stop listed first wins.
    m = check_stop_strings("x abcd", "x abcd", ["abc", "ab"], include_stop_str_in_output=True)
    assert m is not None and (m.stop_str, m.text) == ("abc", "x abc")


def test_stop_split_across_increments() -> None:
    for include, expected in ((False, "Hello world "), (True, "Hello world STOP")):
        text = ""
        matches = []
        for inc in ["Hello wo", "rld ST", "O", "P more"]:
            text += inc
            matches.append(check_stop_strings(text, inc, ["STOP"], include_stop_str_in_output=include))
        assert matches[:3] == [None, None, None]
        assert matches[3] is not None and matches[3].text == expected


def test_stop_already_seen_is_not_rematched() -> None:
    # An occurrence ending before the increment was an earlier step's business; only new ones count.
    assert check_stop_strings("a STOP b c", " c", ["STOP"]) is None
    m = check_stop_strings("a STOP b STOP", " STOP", ["STOP"])
    assert m is not None and m.text == "a STOP b "


def test_stop_with_detokenizer_stream(byte_tok: PreTrainedTokenizerFast) -> None:
    output = byte_tok.encode(" the fox 你好 jumps 🙂 there", add_special_tokens=False)
    detok = IncrementalDetokenizer(byte_tok, byte_tok.encode("hello", add_special_tokens=False))
    match = None
    for t in output:
        delta = detok.step([t])
        match = check_stop_strings(detok.output_text, delta, ["你好 j"])
        if match:
            break
    assert match is not None and match.text == " the fox "


def test_hold_back_length() -> None:
    assert stop_hold_back(["STOP", "x"]) == 3
    assert stop_hold_back(["x"]) == 0
    assert stop_hold_back([]) == 0
    assert stop_hold_back(["</answer>"]) == len("</answer>") - 1


def test_streaming_with_hold_back_never_leaks_stop_prefix() -> None:
    stop = ["<END>", "!!"]
    text, streamed = "", ""
    for inc in ["Hi", " there <", "EN", "D", "> tail"]:
        text += inc
        match = check_stop_strings(text, inc, stop)
        if match:
            text = match.text
            streamed += text[len(streamed):]
            break
        safe = len(text) - stop_hold_back(stop)
        if safe > len(streamed):
            streamed += text[len(streamed):safe]
        # Nothing streamed may later be cut: no character of the stop string goes out early.
        assert "<" not in streamed
    assert streamed == text == "Hi there "
