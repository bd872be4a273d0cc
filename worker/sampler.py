"""Batched next-token sampling with vLLM semantics: penalties, min_tokens, greedy, temperature, top-k/p/min-p.

Order per step (as vLLM v1's sampler): raw logprobs -> logit_bias -> penalties -> grammar masks (constrained rows) ->
min_tokens EOS/stop masking -> greedy argmax or (temperature -> top-k -> top-p -> min-p -> softmax -> sample). The
returned logprobs are the model's own, taken before any of it (vLLM's default ``logprobs_mode``, raw_logprobs): a
bias changes which token is sampled, not the logprob reported for it. ``logit_bias`` is a sparse add on the rows
whose request has one (vLLM adds it, as a logits processor, before the penalties: the two do not commute under a
repetition penalty); the other rows are untouched. Grammar masks are filled per constrained row and applied in one
batched fill; free rows are untouched. A constrained row that min_tokens would leave with no token (the grammar
allows only EOS) keeps the grammar's choice: the output must stay valid. Everything is vectorized over the batch
with per-row parameter tensors; only the noise of seeded rows is drawn per row, from that sequence's own generator,
so a seeded request samples the same tokens whatever else is in the batch. Every bit of a seed counts
(:func:`seeded_generator`): torch's CPU generator keeps only a seed's low 32 bits, so -1 and 2**63-1 (or 0 and
-2**63) would otherwise sample alike.
"""

from __future__ import annotations

import functools
import random
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from keepwarm.worker.outputs import TokenLogprob
from keepwarm.worker.sampling_params import SEED_MAX, SEED_MIN, SamplingParams
from keepwarm.worker.structured import unpack_bitmask

if TYPE_CHECKING:  # the engine package imports this module: at run time it would be half-built here
    from keepwarm.worker.engine.sequence import Sequence


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprob | None]  # one per row; None where the request did not ask for logprobs


def _pad(rows: list[list[int]], pad: int, device: torch.device) -> torch.Tensor:
    width = max((len(r) for r in rows), default=0)
    return torch.tensor([r + [pad] * (width - len(r)) for r in rows], dtype=torch.long, device=device)


def apply_penalties(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """Return ``logits`` with repetition (prompt + output), frequency and presence (output) penalties applied.

    Out of place; rows whose request has neutral penalties are copied unchanged.
    """
    rows = [i for i, s in enumerate(seqs) if s.sampling_params.needs_penalties]
    logits = logits.clone()
    if not rows:
        return logits
    pen_seqs = [seqs[i] for i in rows]
    vocab = logits.shape[1]
    device = logits.device
    sub = logits[rows]
    # Pad with an extra column `vocab` that is dropped afterwards, so ragged rows scatter in one call.
    out_ids = _pad([s.output_token_ids for s in pen_seqs], vocab, device)
    counts = torch.zeros(len(rows), vocab + 1, device=device)
    counts.scatter_add_(1, out_ids, torch.ones_like(out_ids, dtype=counts.dtype))
    counts = counts[:, :vocab]
    occurred = counts > 0

    rep = torch.tensor([s.sampling_params.repetition_penalty for s in pen_seqs], device=device)
    if bool((rep != 1.0).any()):
        prompt_ids = _pad([s.prompt_token_ids for s in pen_seqs], vocab, device)
        seen = torch.zeros(len(rows), vocab + 1, dtype=torch.bool, device=device)
        seen.scatter_(1, prompt_ids, True)
        seen = seen[:, :vocab] | occurred
        rep = rep[:, None]
        # HF/vLLM rule: shrink positive logits, push negative ones further down.
        sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
    freq = torch.tensor([s.sampling_params.frequency_penalty for s in pen_seqs], device=device)
    pres = torch.tensor([s.sampling_params.presence_penalty for s in pen_seqs], device=device)
    sub = sub - freq[:, None] * counts - pres[:, None] * occurred.to(sub.dtype)
    logits[rows] = sub
    return logits


def add_logit_bias(logits: torch.Tensor, params: list[SamplingParams], rows: list[int]) -> torch.Tensor:
    """``logits`` (out of place) plus each listed row's ``logit_bias``: one sparse add over (row, token id) pairs,
    at most 300 per row (SamplingParams' limit). A token id outside the logits is an error naming it (the servers
    refuse such a request before it runs; this keeps an offline one from indexing out of range)."""
    row_ids: list[int] = []
    cols: list[int] = []
    values: list[float] = []
    for i in rows:
        bias = params[i].logit_bias or {}
        row_ids += [i] * len(bias)
        cols += bias.keys()
        values += bias.values()
    vocab = logits.shape[1]
    if max(cols) >= vocab:
        raise ValueError(f"logit_bias token id {max(cols)} is outside the vocabulary (size {vocab})")
    device = logits.device
    # accumulate: the bias is added to the logit (without it, index_put would replace the logit by the bias).
    return logits.index_put((torch.tensor(row_ids, device=device), torch.tensor(cols, device=device)),
                            torch.tensor(values, dtype=logits.dtype, device=device), accumulate=True)


_MT_HEADER = struct.Struct("<QiiQ")  # torch's CPU generator state: seed, left, seeded, next, then 624 words


@functools.cache
def _cpu_state_template() -> bytes | None:
    """torch's CPU generator state after ``manual_seed(5489)``, if its layout is the one :func:`seeded_generator`
    writes (checked against the reference mt19937 seeding); None if this torch lays it out otherwise."""
    g = torch.Generator()
    g.manual_seed(5489)
    raw = bytes(g.get_state().tolist())
    words = [5489]
    for j in range(1, 624):
        words.append((1812433253 * (words[-1] ^ (words[-1] >> 30)) + j) & 0xFFFFFFFF)
    size = _MT_HEADER.size + 624 * 8
    if len(raw) < size or raw[:_MT_HEADER.size] != _MT_HEADER.pack(5489, 1, 1, 0) or \
            struct.unpack_from("<624Q", raw, _MT_HEADER.size) != tuple(words):
        return None
    return raw


def seeded_generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    """A generator whose stream depends on all 64 bits of ``seed`` (an int64, as the API takes).

    CUDA's Philox takes the 64-bit seed as it is. torch seeds its CPU mt19937 from the low 32 bits alone, so seeds
    in ``[0, 2**32)`` keep torch's seeding (``torch.manual_seed``'s streams) and any other seed gets the whole
    mt19937 state from its two 32-bit words by the reference ``init_by_array`` (what Python's ``random`` does):
    distinct seeds, distinct states."""
    gen = torch.Generator(device=device)
    own = gen.device.type == "cpu" and SEED_MIN <= seed <= SEED_MAX and not 0 <= seed < 1 << 32
    template = _cpu_state_template() if own else None
    if template is None:  # torch's seeding (which refuses what it cannot take, as before)
        gen.manual_seed(seed)
        return gen
    u64 = seed & 0xFFFFFFFFFFFFFFFF
    words = random.Random(u64).getstate()[1][:624]  # init_by_array([low word, high word])
    raw = bytearray(template)
    _MT_HEADER.pack_into(raw, 0, u64, 1, 1, 0)  # left = 1: the first draw regenerates, as after a fresh seed
    struct.pack_into("<624Q", raw, _MT_HEADER.size, *words)
    gen.set_state(torch.frombuffer(raw, dtype=torch.uint8))
    return gen


class Sampler:
    """Stateless except for one ``torch.Generator`` per seeded sequence (drop it with :meth:`forget`)."""

    def __init__(self) -> None:
        self._generators: dict[str, torch.Generator] = {}

    def forget(self, seq_id: str) -> None:
        """Drop the generator of a finished (or aborted) seeded sequence."""
        self._generators.pop(seq_id, None)

    def _generator(self, seq: Sequence, device: torch.device) -> torch.Generator:
        gen = self._generators.get(seq.seq_id)
        if gen is None:
            gen = seeded_generator(seq.sampling_params.seed, device)
            self._generators[seq.seq_id] = gen
        return gen

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> SamplerOutput:
        if logits.dim() != 2 or logits.shape[0] != len(seqs):
            raise ValueError(f"logits must be [{len(seqs)}, vocab], got {tuple(logits.shape)}")
        logits = logits.float()
        params = [s.sampling_params for s in seqs]
        num_rows, vocab = logits.shape
        device = logits.device

        lp_rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        raw_logprobs = torch.log_softmax(logits[lp_rows], dim=-1) if lp_rows else None

        min_tok_rows = [i for i, s in enumerate(seqs) if s.num_output_tokens < s.sampling_params.min_tokens]
        grammar_rows = [i for i, s in enumerate(seqs) if s.grammar is not None]
        bias_rows = [i for i, p in enumerate(params) if p.logit_bias]
        # These steps work on a copy: the caller's tensor stays untouched.
        if bias_rows:
            logits = add_logit_bias(logits, params, bias_rows)
        if any(p.needs_penalties for p in params):
            logits = apply_penalties(logits, seqs)
        elif (min_tok_rows or grammar_rows) and not bias_rows:
            logits = logits.clone()
        grammar_logits = None
        if grammar_rows:
            grammar_logits = self._apply_grammars(logits, seqs, grammar_rows)
        if min_tok_rows:
            rows: list[int] = []
            cols: list[int] = []
            for i in min_tok_rows:
                p = params[i]
                banned = {t for t in (*p.eos_token_ids, *p.stop_token_ids) if 0 <= t < vocab}
                rows += [i] * len(banned)
                cols += sorted(banned)
            if rows:
                logits[torch.tensor(rows, device=device), torch.tensor(cols, device=device)] = float("-inf")
            if grammar_logits is not None:
                self._keep_grammar_choice(logits, grammar_logits, grammar_rows)

        greedy_rows = [i for i, p in enumerate(params) if p.greedy]
        if len(greedy_rows) == num_rows:
            tokens = logits.argmax(dim=-1)
        else:
            sampled_rows = [i for i, p in enumerate(params) if not p.greedy]
            sampled = self._sample_rows(logits if not greedy_rows else logits[sampled_rows],
                                        [seqs[i] for i in sampled_rows])
            if greedy_rows:
                tokens = torch.empty(num_rows, dtype=torch.long, device=device)
                tokens[greedy_rows] = logits[greedy_rows].argmax(dim=-1)
                tokens[sampled_rows] = sampled
            else:
                tokens = sampled

        token_ids: list[int] = tokens.tolist()
        logprobs: list[TokenLogprob | None] = [None] * num_rows
        if raw_logprobs is not None:
            self._fill_logprobs(logprobs, raw_logprobs, lp_rows, tokens, params)
        return SamplerOutput(token_ids=token_ids, logprobs=logprobs)

    @staticmethod
    def _apply_grammars(logits: torch.Tensor, seqs: list[Sequence], rows: list[int]) -> torch.Tensor:
        """Mask the constrained rows of ``logits`` in place; returns those rows after masking (a copy)."""
        vocab = logits.shape[1]
        bitmask = torch.zeros(len(rows), (vocab + 31) // 32, dtype=torch.int32)
        for j, i in enumerate(rows):
            grammar = seqs[i].grammar
            assert grammar is not None  # rows are the constrained ones
            grammar.fill_bitmask(bitmask[j])
        allowed = unpack_bitmask(bitmask, vocab).to(logits.device)
        masked = logits[rows].masked_fill_(~allowed, float("-inf"))
        logits[rows] = masked
        return masked

    @staticmethod
    def _keep_grammar_choice(logits: torch.Tensor, grammar_logits: torch.Tensor, rows: list[int]) -> None:
        """Constrained rows that min_tokens emptied (only EOS was allowed) go back to the grammar's mask alone."""
        dead = torch.isneginf(logits[rows]).all(dim=-1)
        if bool(dead.any()):
            idx = torch.tensor(rows, device=logits.device)[dead]
            logits[idx] = grammar_logits[dead]

    def _sample_rows(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """Sample one token per row of ``logits`` (all rows non-greedy); ``logits`` is not modified."""
        params = [s.sampling_params for s in seqs]
        num_rows, vocab = logits.shape
        device = logits.device

        temps = [p.temperature for p in params]
        if any(t != 1.0 for t in temps):
            logits = logits / torch.tensor(temps, device=device)[:, None]

        use_top_k = any(0 < p.top_k < vocab for p in params)
        use_top_p = any(p.top_p < 1.0 for p in params)
        if use_top_k or use_top_p:
            # Stable descending sort: equal logits keep lowest-id-first order, so top_k=1 matches argmax.
            sorted_logits, order = logits.sort(dim=-1, descending=True, stable=True)
            if use_top_k:
                k = torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in params], device=device)
                positions = torch.arange(vocab, device=device)
                sorted_logits.masked_fill_(positions[None, :] >= k[:, None], float("-inf"))
            if use_top_p:
                # inf for disabled rows: float rounding of the cumsum must never cut their tail.
                top_p = torch.tensor([p.top_p if p.top_p < 1.0 else float("inf") for p in params],
                                     device=device)
                probs_sorted = sorted_logits.softmax(dim=-1)
                # Keep the smallest prefix reaching top_p: drop a token once the mass before it is >= top_p.
                mass_before = probs_sorted.cumsum(dim=-1) - probs_sorted
                sorted_logits.masked_fill_(mass_before >= top_p[:, None], float("-inf"))
            logits = torch.empty_like(sorted_logits).scatter_(1, order, sorted_logits)

        probs = logits.softmax(dim=-1)
        if any(p.min_p > 0.0 for p in params):
            min_p = torch.tensor([p.min_p for p in params], device=device)
            threshold = probs.amax(dim=-1, keepdim=True) * min_p[:, None]
            # No renormalization needed: the exponential race below is invariant to row scale.
            probs = probs.masked_fill(probs < threshold, 0.0)

        # Exponential race: argmax(p_i / E_i) with E_i ~ Exp(1) samples i with probability p_i.
        noise = torch.empty_like(probs)
        seeded = [j for j, p in enumerate(params) if p.seed is not None]
        if len(seeded) < num_rows:
            noise.exponential_()
        for j in seeded:
            noise[j].exponential_(generator=self._generator(seqs[j], device))
        # A zero draw would turn a masked 0/0 into NaN, which argmax picks.
        noise.clamp_min_(torch.finfo(noise.dtype).tiny)
        return (probs / noise).argmax(dim=-1)

    @staticmethod
    def _fill_logprobs(out: list[TokenLogprob | None], raw_logprobs: torch.Tensor, rows: list[int],
                       tokens: torch.Tensor, params: list[SamplingParams]) -> None:
        chosen_ids = tokens[rows]
        chosen = raw_logprobs.gather(1, chosen_ids[:, None])
        # 1-based rank in the raw distribution, as vLLM/OpenAI report it.
        ranks = (raw_logprobs > chosen).sum(dim=-1) + 1
        max_k = max(params[i].logprobs for i in rows)
        top_vals: list[list[float]] = [[] for _ in rows]
        top_ids: list[list[int]] = [[] for _ in rows]
        if max_k > 0:
            vals, ids = raw_logprobs.topk(min(max_k, raw_logprobs.shape[1]), dim=-1)
            top_vals, top_ids = vals.tolist(), ids.tolist()
        for j, (i, tok, lp, rank) in enumerate(zip(rows, chosen_ids.tolist(), chosen[:, 0].tolist(),
                                                 ranks.tolist(), strict=True)):
            k = params[i].logprobs
            out[i] = TokenLogprob(token_id=tok, logprob=lp, rank=rank,
                                  top=tuple(zip(top_ids[j][:k], top_vals[j][:k], strict=True)))
