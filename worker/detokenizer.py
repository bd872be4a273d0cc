"""Incremental detokenization (vLLM's prefix/read-offset technique) and stop-string checking.

Decoding a token on its own is wrong for most tokenizers: SentencePiece-style decoders drop the leading space
of the first token, and byte-level tokens may hold half a UTF-8 character. So each step decodes a small window
``ids[prefix_offset:]`` and subtracts the decoding of ``ids[prefix_offset:read_offset]``; text ending in
U+FFFD (an incomplete character) is held back until a later token completes it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

# How many prompt tokens seed the decode window (vLLM's INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET).
INITIAL_OFFSET = 5
REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Turns a stream of output token ids into text increments that never split a character.

    ``tokenizer`` is a transformers tokenizer backed by ``tokenizers`` (its ``backend_tokenizer`` is used
    directly: faster, and without ``clean_up_tokenization_spaces``, which is not incremental), or anything
    with ``decode(ids, skip_special_tokens=...)`` such as a raw ``tokenizers.Tokenizer``.
    """

    def __init__(self, tokenizer: Any, prompt_token_ids: Sequence[int],
                 skip_special_tokens: bool = True) -> None:
        backend = getattr(tokenizer, "backend_tokenizer", None)
        decoder = backend if backend is not None else tokenizer
        self._decode: Callable[[list[int]], str] = (
            lambda ids: decoder.decode(ids, skip_special_tokens=skip_special_tokens))
        # The prompt's tail gives the first output token its left context (e.g. its leading space).
        self._ids: list[int] = list(prompt_token_ids[-INITIAL_OFFSET:])
        self.read_offset = len(self._ids)
        self.prefix_offset = 0
        self.output_text = ""

    def step(self, new_token_ids: Sequence[int]) -> str:
        """Append tokens; return the newly completed text ("" while a character is still incomplete)."""
        if not new_token_ids:
            return ""
        self._ids.extend(new_token_ids)
        return self._advance(final=False)

    def flush(self) -> str:
        """At the end of a request, emit any held-back text, even if it ends in an incomplete character."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        prefix_text = self._decode(self._ids[self.prefix_offset:self.read_offset])
        new_text = self._decode(self._ids[self.prefix_offset:])
        if len(new_text) <= len(prefix_text) or (new_text.endswith(REPLACEMENT_CHAR) and not final):
            return ""
        delta = new_text[len(prefix_text):]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self._ids)
        # Drop ids that can no longer enter a window, so long generations do not keep them all.
        if self.prefix_offset > 256:
            del self._ids[:self.prefix_offset]
            self.read_offset -= self.prefix_offset
            self.prefix_offset = 0
        self.output_text += delta
        return delta


@dataclass(frozen=True)
class StopMatch:
    stop_str: str
    text: str  # accumulated output, cut before the stop (after it with include_stop_str_in_output)


def stop_hold_back(stop: Sequence[str]) -> int:
    """Characters a streaming API must withhold from the end of the text so it never streams the start of a
    stop string that a later token completes (and that will then be cut from the output)."""
    return max((len(s) for s in stop), default=1) - 1


def streamable_end(text: str, sent: int, finished: bool, hold_back: int) -> int:
    """How far a streaming API may send ``text``: all of it once the sequence finished, else all but the last
    ``hold_back`` characters (a stop string may still complete there and be cut), never less than already sent."""
    return len(text) if finished else max(sent, len(text) - hold_back)


def check_stop_strings(output_text: str, new_text: str, stop: Sequence[str],
                       include_stop_str_in_output: bool = False) -> StopMatch | None:
    """Find the earliest stop string occurrence that ends inside ``new_text``.

    ``output_text`` is all text so far and already ends with the increment ``new_text`` (as
    ``IncrementalDetokenizer.output_text`` does after ``step``). Occurrences ending before the increment were
    checked on earlier steps, so only the increment and the ``longest stop - 1`` characters before it are
    searched. Ties (same start) go to the stop string listed first.
    """
    if not new_text or not stop:
        return None
    num_new = len(new_text)
    before = min(len(output_text) - num_new, stop_hold_back(stop))  # old characters searched again
    base = len(output_text) - num_new - before  # index of window[0] in output_text
    window = output_text[base:]
    best: tuple[int, str] | None = None
    for s in stop:
        # Start late enough that the match ends in the new text.
        idx = window.find(s, max(0, before - len(s) + 1))
        if idx != -1 and (best is None or idx < best[0]):
            best = (idx, s)
    if best is None:
        return None
    idx, s = best
    end = base + idx + (len(s) if include_stop_str_in_output else 0)
    return StopMatch(stop_str=s, text=output_text[:end])
