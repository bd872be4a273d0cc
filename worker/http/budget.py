"""What one generation request may cost, checked in one place before any work is done for it.

Rules (the limits, their defaults and the tests that hold them: docs/reliability.md):
- **sequences**: prompts x ``n`` at most ``--max-request-sequences`` (default ``--max-num-seqs``: one request may fill
  one batch, no more); 400 naming ``prompt`` (several prompts) or ``n``, before a prompt is tokenized;
- **prompt tokens**, summed over the request's prompts: at most ``--max-request-prompt-tokens`` (default: the KV
  cache's tokens); token-id prompts count as sent, text prompts are first bounded by their characters (a token
  stands for at most the vocabulary's longest entry; ``NORMALIZATION_SLACK``), then tokenized in chunks of
  ``CHUNK_CHARS`` off the event loop, stopping at the limit instead of materialising the whole list;
- **output tokens**: ``max_tokens`` is bounded per sequence by the context (pipeline.check_length);
- **admission** then holds one seat per sequence (keepwarm.worker.http.limits.Admission): 429 when the server is
  full, with nothing tokenized.
Grammars, schemas, choices and stop lists are bounded where they are compiled (keepwarm.worker.structured), a
chat template's output by its renderer (keepwarm.worker.tokenizer); a body by ``--max-request-body-mb``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from keepwarm.worker.http.limits import chars_bound, offload
from keepwarm.worker.openai.protocol import bad_request

# Characters tokenized per offloaded call: the offload pool and the GIL are shared with every other request.
CHUNK_CHARS = 1 << 18


@dataclass(frozen=True)
class RequestBudget:
    """The per-request limits of one server (``ServerState.budget``)."""

    max_sequences: int
    max_prompt_tokens: int
    token_chars: int  # the most characters one token stands for

    def check_sequences(self, prompts: int, n: int) -> int:
        """The request's sequences (prompts x n); 400 past ``max_sequences``."""
        sequences = prompts * n
        if sequences > self.max_sequences:
            raise bad_request(f"this request asks for {sequences} sequences ({prompts} prompt(s) x n={n}); one "
                              f"request may ask for at most {self.max_sequences} (--max-request-sequences)",
                              "prompt" if prompts > 1 else "n")
        return sequences

    def check_prompt_tokens(self, tokens: int, param: str) -> None:
        if tokens > self.max_prompt_tokens:
            raise bad_request(f"this request's prompts hold more than {self.max_prompt_tokens} tokens together "
                              f"(--max-request-prompt-tokens); {tokens} or more were sent", param)

    def check_prompt_chars(self, chars: int, param: str) -> None:
        """400 for prompts whose characters cannot fit in ``max_prompt_tokens`` however they tokenize."""
        limit = chars_bound(self.max_prompt_tokens, self.token_chars)
        if chars > limit:
            raise bad_request(f"this request's prompts hold {chars} characters; at most {limit} could fit in "
                              f"{self.max_prompt_tokens} tokens (--max-request-prompt-tokens)", param)

    def count_token_prompts(self, prompts: Sequence[Sequence[int]], param: str) -> None:
        self.check_prompt_tokens(sum(len(p) for p in prompts), param)

    async def tokenize(self, tokenizer: Any, texts: Sequence[str], param: str) -> list[list[int]]:
        """Token ids of each text, tokenized off the event loop in chunks of about ``CHUNK_CHARS`` characters;
        400 as soon as their sum passes ``max_prompt_tokens`` (the rest is never tokenized)."""
        self.check_prompt_chars(sum(len(t) for t in texts), param)
        out: list[list[int]] = []
        start, total = 0, 0
        while start < len(texts):
            end, chars = start + 1, len(texts[start])
            while end < len(texts) and chars + len(texts[end]) <= CHUNK_CHARS:
                chars += len(texts[end])
                end += 1
            chunk = await offload(self._encode_chunk, tokenizer, texts[start:end], total, param)
            total += sum(len(ids) for ids in chunk)
            out.extend(chunk)
            start = end
        return out

    def _encode_chunk(self, tokenizer: Any, texts: Sequence[str], before: int, param: str) -> list[list[int]]:
        total, out = before, []
        for t in texts:
            ids = tokenizer.encode(t)
            total += len(ids)
            self.check_prompt_tokens(total, param)
            out.append(ids)
        return out
