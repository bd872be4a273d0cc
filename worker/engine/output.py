"""Output processing: each sampled token -> its sequence, text, stops and logprobs -> ``RequestOutput`` objects.

Rules:
- Stops, in vLLM's order: a stop token id or EOS (once ``min_tokens`` are out) ends a sequence and is not text;
  else the token is detokenized and the stop strings are looked for where the new text ends (the text is cut
  before the stop, after it with ``include_stop_str_in_output``); else a grammar that takes nothing more,
  ``max_tokens`` or ``max_model_len`` ends it, and text held back for an incomplete character is flushed.
- Prompt logprobs are recorded chunk by chunk as the prefill runs; positions recomputed after a preemption are not
  recorded twice.
- Isolation: an exception tied to one request (its prompt logprobs, its token, its output) is collected in the
  step's ``Failures`` and ends that request alone (``fail_request``: its sequences aborted, one log line, a final
  output with ``error``).
- An output copies the sequences' lists: the engine thread keeps appending while a front end reads it.
- longrope: a sequence first outgrowing the original context is recomputed with the long factors, as transformers.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from keepwarm.worker.detokenizer import IncrementalDetokenizer, check_stop_strings
from keepwarm.worker.engine.scheduler import Scheduler
from keepwarm.worker.engine.sequence import Sequence, SequenceStatus
from keepwarm.worker.engine.stats import EngineStats
from keepwarm.worker.outputs import CompletionOutput, RequestMetrics, RequestOutput, TokenLogprob
from keepwarm.worker.sampler import Sampler

log = logging.getLogger("keepwarm.worker")


@dataclass
class RequestState:
    """One request inside the engine: its ``n`` sequences, their detokenizers and texts so far."""

    request_id: str
    prompt: str | None
    seqs: list[Sequence]
    detoks: list[IncrementalDetokenizer | None]
    texts: list[str]
    metrics: RequestMetrics


# A step's requests that failed alone, by request id: (the request, what it raised); the first failure counts.
Failures = dict[str, tuple[RequestState, BaseException]]
# (sequence, first index into the step's logit rows, first prompt position, rows): prompt rows whose logprobs
# were asked for.
PromptRows = list[tuple[Sequence, int, int, int]]


class OutputProcessor:
    """The requests in the engine, and everything that happens to them after sampling (module docstring)."""

    def __init__(self, scheduler: Scheduler, sampler: Sampler, stats: EngineStats, max_model_len: int,
                 long_rope_after: int | None) -> None:
        self.scheduler = scheduler
        self.sampler = sampler
        self.stats = stats
        self.max_model_len = max_model_len
        self.long_rope_after = long_rope_after
        self.requests: dict[str, RequestState] = {}
        self.seq_to_request: dict[str, RequestState] = {}

    def add(self, req: RequestState) -> None:
        self.requests[req.request_id] = req
        for seq in req.seqs:
            self.seq_to_request[seq.seq_id] = req

    def blame(self, failed: Failures, seq: Sequence, error: BaseException) -> None:
        """``error`` is the fault of ``seq``'s request alone."""
        req = self.seq_to_request.get(seq.seq_id)
        if req is not None:
            failed.setdefault(req.request_id, (req, error))

    # -- a step's tokens ---------------------------------------------------------------------------------------
    def process(self, sampled: list[tuple[Sequence, tuple[int, TokenLogprob | None]]],
                failed: Failures) -> list[RequestOutput]:
        """Append each sampled token to its sequence, check its stops, and make each touched request's output."""
        outputs: list[RequestOutput] = []
        touched: dict[str, RequestState] = {}
        now = time.monotonic()
        step_tokens = 0
        for seq, (token, lp) in sampled:
            req = self.seq_to_request.get(seq.seq_id)
            if req is None or req.request_id in failed:
                continue
            try:
                seq.append_token(token, lp)
                step_tokens += self.stats.record_token(seq, now)
                self.stats.generation_tokens += 1
                touched[req.request_id] = req
                self.process_token(req, seq, token)
            except Exception as e:  # noqa: BLE001 - this request's fault alone
                failed[req.request_id] = (req, e)
        for rid, req in touched.items():
            if rid in failed:
                continue
            try:
                outputs.append(self.make_output(req))
            except Exception as e:  # noqa: BLE001
                failed[rid] = (req, e)
        if step_tokens and self.stats.observations is not None:
            self.stats.observations.iteration_tokens.append(step_tokens)
        return outputs

    def process_token(self, req: RequestState, seq: Sequence, token: int) -> None:
        p = seq.sampling_params
        idx = req.seqs.index(seq)
        status = None
        if token in (p.stop_token_ids or ()) and seq.num_output_tokens >= p.min_tokens:
            status, seq.stop_reason = SequenceStatus.FINISHED_STOPPED, token
        elif token in p.eos_token_ids and seq.num_output_tokens >= p.min_tokens:
            status = SequenceStatus.FINISHED_STOPPED
        grammar_done = False
        if status is None and seq.grammar is not None:
            if not seq.grammar.accept(token):  # the mask allows only what the grammar takes: an engine bug
                log.error("request %s: the grammar rejected sampled token %d (%s)", req.request_id, token,
                          seq.grammar.error)
            # Complete: the grammar takes nothing but EOS, which would not be part of the text anyway.
            grammar_done = seq.grammar.is_stopped
        detok = req.detoks[idx]
        if detok is not None and status is None:  # an EOS / stop token is not part of the text
            new_text = detok.step([token])
            req.texts[idx] = detok.output_text
            if p.stop and new_text and seq.num_output_tokens >= p.min_tokens:
                hit = check_stop_strings(detok.output_text, new_text, p.stop, p.include_stop_str_in_output)
                if hit is not None:
                    status, seq.stop_reason = SequenceStatus.FINISHED_STOPPED, hit.stop_str
                    req.texts[idx] = hit.text
        if status is None:
            out_of_tokens = p.max_tokens is not None and seq.num_output_tokens >= p.max_tokens
            if grammar_done:
                status = SequenceStatus.FINISHED_STOPPED
            elif out_of_tokens or seq.num_tokens >= self.max_model_len:
                status = SequenceStatus.FINISHED_LENGTH
            if status is not None and detok is not None:
                detok.flush()  # text held back for an incomplete character is final now
                req.texts[idx] = detok.output_text
        if status is not None:
            self.finish(seq, status)
        elif self.long_rope_after is not None and not seq.rope_long and seq.num_tokens > self.long_rope_after:
            self.scheduler.recompute(seq)  # the whole cache again, with the long factors
            seq.use_long_rope()

    def make_output(self, req: RequestState) -> RequestOutput:
        finished = all(s.is_finished for s in req.seqs)
        first = [s.first_token_time for s in req.seqs if s.first_token_time is not None]
        req.metrics.first_token_time = min(first) if first else None
        req.metrics.num_cached_tokens = req.seqs[0].num_cached_prompt_tokens
        outs: list[CompletionOutput] = []
        for i, seq in enumerate(req.seqs):
            lps = list(seq.output_logprobs) if seq.sampling_params.logprobs is not None else None
            outs.append(CompletionOutput(
                index=i, text=req.texts[i], token_ids=list(seq.output_token_ids),
                cumulative_logprob=sum(x.logprob for x in lps) if lps else None, logprobs=lps,
                finish_reason=seq.status.value if seq.is_finished else None, stop_reason=seq.stop_reason))
        if finished:
            req.metrics.finished_time = time.monotonic()
            self._forget(req)
        return RequestOutput(req.request_id, req.prompt, list(req.seqs[0].prompt_token_ids), outs, finished,
                             metrics=req.metrics, prompt_logprobs=req.seqs[0].prompt_logprobs)

    # -- prompt logprobs ---------------------------------------------------------------------------------------
    def record_prompt_logprobs(self, logits: torch.Tensor, prompt_rows: PromptRows, failed: Failures) -> None:
        for seq, first, start_pos, n in prompt_rows:
            try:
                self.prompt_logprobs_of(seq, logits[first:first + n], start_pos, n)
            except Exception as e:  # noqa: BLE001 - this request's fault alone
                self.blame(failed, seq, e)

    @staticmethod
    def prompt_logprobs_of(seq: Sequence, logits: torch.Tensor, start_pos: int, n: int) -> None:
        assert seq.prompt_logprobs is not None
        lp = torch.log_softmax(logits, dim=-1)
        targets = torch.tensor(seq.prompt_token_ids[start_pos + 1:start_pos + 1 + n])
        chosen = lp.gather(1, targets[:, None])[:, 0]
        ranks = (lp > chosen[:, None]).sum(dim=-1) + 1
        k = seq.sampling_params.prompt_logprobs or 0
        top_k = lp.topk(k, dim=-1) if k else None
        for i in range(n):
            if start_pos + 1 + i < len(seq.prompt_logprobs):
                continue  # recomputed after a preemption: already recorded
            top = () if top_k is None else tuple(zip(top_k.indices[i].tolist(), top_k.values[i].tolist(),
                                                     strict=True))
            seq.prompt_logprobs.append(TokenLogprob(int(targets[i]), float(chosen[i]), int(ranks[i]), top))

    # -- ending sequences and requests -------------------------------------------------------------------------
    def finish(self, seq: Sequence, status: SequenceStatus, reason: str | None = None) -> None:
        """End ``seq``; ``reason`` (default: its status) is what the metrics count it as."""
        self.scheduler.finish(seq, status)
        self.sampler.forget(seq.seq_id)
        self.stats.sequence_finished(seq, reason or status.value)

    def abort(self, request_id: str) -> bool:
        req = self.requests.pop(request_id, None)
        if req is None:
            return False
        for seq in req.seqs:
            if not seq.is_finished:
                self.finish(seq, SequenceStatus.FINISHED_ABORTED)
            self.seq_to_request.pop(seq.seq_id, None)
        self.stats.request_ended(req.seqs)
        return True

    def fail_request(self, req: RequestState, error: BaseException) -> RequestOutput:
        """End ``req`` alone after an internal error tied to it: abort its sequences (KV freed), say so once."""
        log.error("request %s failed inside the engine and was aborted: %s: %s", req.request_id,
                  type(error).__name__, error, exc_info=error)
        for seq in req.seqs:
            if not seq.is_finished:
                self.finish(seq, SequenceStatus.FINISHED_ABORTED, reason="error")  # vLLM's "error": a 500
        self._forget(req)
        req.metrics.finished_time = time.monotonic()
        outs: list[CompletionOutput] = [
            CompletionOutput(index=i, text=req.texts[i], token_ids=list(seq.output_token_ids),
                             finish_reason=SequenceStatus.FINISHED_ABORTED.value)
            for i, seq in enumerate(req.seqs)]
        return RequestOutput(req.request_id, req.prompt, list(req.seqs[0].prompt_token_ids), outs, True,
                             metrics=req.metrics, error=f"{type(error).__name__}: {error}")

    def _forget(self, req: RequestState) -> None:
        """Every sequence of ``req`` has ended: drop it, count it."""
        self.requests.pop(req.request_id, None)
        self.stats.request_ended(req.seqs)
        for seq in req.seqs:
            self.seq_to_request.pop(seq.seq_id, None)
