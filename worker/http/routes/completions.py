"""POST /v1/completions: OpenAI's legacy completions (several prompts, n choices each, echo, logprobs).

``echo`` with ``logprobs`` returns the prompt's tokens with their logprobs before the output's (the first prompt
token has none), as vLLM does: lm-evaluation-harness scores log-likelihoods this way (``max_tokens: 1``, the one
generated token dropped on its side). ``echo`` with ``max_tokens: 0`` scores the prompt alone (``score_prompts``):
the prompt as the text, its tokens' logprobs when ``logprobs`` is given, ``finish_reason`` "length", no completion
tokens. vLLM's ``prompt_logprobs``, ``logit_bias`` (token ids checked against the vocabulary here) and the
structured-output fields (``guided_*``, ``structured_outputs``, ``response_format``) work here too."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from contextlib import aclosing
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from keepwarm.worker.http import pipeline
from keepwarm.worker.http.limits import check_prompt_chars, offload
from keepwarm.worker.http.state import ServerState
from keepwarm.worker.lora import LoRAAdapter
from keepwarm.worker.openai.protocol import CompletionRequest, bad_request, new_id, now
from keepwarm.worker.openai.structured_fields import structured_spec
from keepwarm.worker.outputs import CompletionOutput, RequestOutput, TokenLogprob
from keepwarm.worker.sampling_params import SamplingParams


def text_offsets(tokenizer: Any, token_ids: list[int], start: int, end: int, skip_special_tokens: bool,
                 text_len: int) -> list[int]:
    """Where each of ``token_ids[start:end]`` begins in the returned text: the length of the text decoded from the
    tokens before it, decoded as the output was (hidden special tokens add nothing), capped at the text's length
    (a stop string cuts the text)."""
    return [min(len(tokenizer.decode(token_ids[:i], skip_special_tokens=skip_special_tokens)), text_len)
            for i in range(start, end)]


def completion_logprobs(tokenizer: Any, lps: list[TokenLogprob], offsets: list[int]) -> dict[str, Any]:
    return {"tokens": [tokenizer.decode([x.token_id]) for x in lps], "token_logprobs": [x.logprob for x in lps],
            "top_logprobs": [{tokenizer.decode([t]): lp for t, lp in x.top} for x in lps],
            "text_offset": offsets}


def prompt_completion_logprobs(tokenizer: Any, prompt_ids: list[int], lps: list[TokenLogprob | None],
                               text_len: int) -> dict[str, Any]:
    """Echo: the prompt's tokens with their logprobs; the first has none (nothing comes before it), as vLLM.
    ``text_offset`` counts from the start of the echoed prompt (decoded as the echo was, specials kept)."""
    first = tokenizer.decode([prompt_ids[0]])
    offsets = text_offsets(tokenizer, prompt_ids, 1, len(prompt_ids), False, text_len)
    rest = completion_logprobs(tokenizer, [x for x in lps if x is not None], offsets)
    return {"tokens": [first, *rest["tokens"]], "token_logprobs": [None, *rest["token_logprobs"]],
            "top_logprobs": [None, *rest["top_logprobs"]], "text_offset": [0, *rest["text_offset"]]}


def vllm_prompt_logprobs(tokenizer: Any, lps: list[TokenLogprob | None] | None) -> list[dict | None] | None:
    """vLLM's ``prompt_logprobs``: per prompt token, {token id: {logprob, rank, decoded_token}} (None first)."""
    if lps is None:
        return None
    out: list[dict | None] = []
    for x in lps:
        if x is None:
            out.append(None)
            continue
        entry = {str(t): {"logprob": lp, "rank": r + 1, "decoded_token": tokenizer.decode([t])}
                 for r, (t, lp) in enumerate(x.top)}
        entry[str(x.token_id)] = {"logprob": x.logprob, "rank": x.rank,
                                  "decoded_token": tokenizer.decode([x.token_id])}
        out.append(entry)
    return out


def _check_fields(state: ServerState, req: CompletionRequest) -> None:
    """What the model cannot check: best_of equals n (nothing else is supported), logit_bias ids in the vocabulary."""
    if req.best_of is not None and req.best_of != req.n:
        raise bad_request("best_of is not supported (it must equal n)", "best_of")
    req.check_logit_bias(state.engine.model_config.vocab_size)


async def _prompts(state: ServerState, req: CompletionRequest, request: Request
                   ) -> tuple[list[list[int]], list[str | None]]:
    """(token ids, text or None) per prompt; 400 for a shape OpenAI does not allow, a request past its budget
    (sequences, prompt tokens: keepwarm.worker.http.budget; checked before tokenizing, and tokenizing stops at the
    limit), a text that cannot fit the context whatever it tokenizes to, or ids outside the vocab; 429 when the
    server has no seat for its sequences. Tokenizing runs off the event loop, in chunks."""
    p, budget = req.prompt, state.budget
    prompts: list[list[int]]
    texts: list[str | None]
    if isinstance(p, str) or (p and all(isinstance(x, str) for x in p)):
        strs: list[str] = [p] if isinstance(p, str) else list(p)  # type: ignore[arg-type]
        pipeline.admit(state, request, len(strs), req.n)
        check_prompt_chars(max(len(t) for t in strs), state.engine.max_model_len, state.token_chars, "prompt")
        prompts, texts = await budget.tokenize(state.tokenizer, strs, "prompt"), list(strs)
    elif p and all(isinstance(x, int) for x in p):
        prompts, texts = [list(p)], [None]  # type: ignore[arg-type]
    elif p and all(isinstance(x, list) for x in p):
        prompts, texts = [list(x) for x in p], [None] * len(p)  # type: ignore[arg-type]
    else:
        raise bad_request("prompt must be a string, a list of strings, or token ids", "prompt")
    if texts[0] is None:
        pipeline.admit(state, request, len(prompts), req.n)
        budget.count_token_prompts(prompts, "prompt")
    vocab = state.engine.model_config.vocab_size
    for ids in prompts:
        if any(t < 0 or t >= vocab for t in ids):
            raise bad_request(f"prompt token ids must be in [0, {vocab})", "prompt")
    return prompts, texts


def router(state: ServerState) -> APIRouter:
    api = APIRouter()

    @api.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request) -> Any:
        lora = pipeline.resolve_model(state, req.model)
        _check_fields(state, req)
        prompts, texts = await _prompts(state, req, request)
        if req.scores_only:
            return await score_prompts(state, req, request, prompts, texts, lora)
        max_tokens = min(pipeline.check_length(state, len(ids), req.max_tokens) for ids in prompts)
        params = pipeline.request_params(req, max_tokens, req.logprobs)
        if req.echo and req.logprobs is not None and params.prompt_logprobs is None:
            params.prompt_logprobs = req.logprobs  # the echoed prompt's tokens carry logprobs too (as vLLM)
        await pipeline.compile_structured(state, structured_spec(req), params)
        rid = req.request_id or new_id("cmpl")
        head = {"id": rid, "object": "text_completion", "created": now(), "model": req.model or state.model_name}
        merged = pipeline.start(state, prompts, texts, params, lora, rid)
        tok = state.tokenizer

        def choice_logprobs(c: CompletionOutput, start: int, end: int, base: int) -> dict | None:
            """Logprobs of tokens start..end; text_offset counts from the start of the returned text, which begins
            ``base`` characters in (after the echoed prompt)."""
            if req.logprobs is None or c.logprobs is None:
                return None
            offsets = text_offsets(tok, c.token_ids, start, end, params.skip_special_tokens, len(c.text))
            return completion_logprobs(tok, c.logprobs[start:end], [base + o for o in offsets])

        def echoed(i: int, out: RequestOutput) -> str:
            return texts[i] or tok.decode(out.prompt_token_ids)

        def echo_logprobs(i: int, out: RequestOutput) -> dict | None:
            if req.logprobs is None or out.prompt_logprobs is None:
                return None
            return prompt_completion_logprobs(tok, out.prompt_token_ids, out.prompt_logprobs[1:],
                                              len(echoed(i, out)))

        def final_logprobs(i: int, out: RequestOutput, c: CompletionOutput) -> dict | None:
            if not req.echo:
                return choice_logprobs(c, 0, len(c.token_ids), 0)
            lps = choice_logprobs(c, 0, len(c.token_ids), len(echoed(i, out)))
            prompt = echo_logprobs(i, out)
            if lps is None or prompt is None:
                return lps
            return {k: prompt[k] + lps[k] for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}

        if not req.stream:
            finals = await pipeline.collect(state, request, merged, len(prompts))
            choices, prompt_tokens, completion_tokens = [], 0, 0
            for i, out in enumerate(finals):
                prompt_tokens += len(out.prompt_token_ids)
                for c in out.outputs:
                    completion_tokens += len(c.token_ids)
                    choice = {"index": i * req.n + c.index, "text": echoed(i, out) + c.text if req.echo
                              else c.text, "logprobs": await offload(final_logprobs, i, out, c),
                              "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
                    if req.prompt_logprobs is not None:
                        choice["prompt_logprobs"] = await offload(vllm_prompt_logprobs, tok, out.prompt_logprobs)
                    choices.append(choice)
            return {**head, "choices": choices,
                    "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                              "total_tokens": prompt_tokens + completion_tokens}}

        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        async def chunks() -> AsyncGenerator[dict[str, Any], None]:
            tracker = pipeline.DeltaTracker(params.stop)
            usage = {"prompt": 0, "completion": 0}
            async with aclosing(merged):
                async for i, out in merged:
                    for c in out.outputs:
                        idx = i * req.n + c.index
                        d = tracker.advance(idx, c)
                        if d.first and req.echo:
                            yield {**head, "choices": [{"index": idx, "text": echoed(i, out),
                                                        "logprobs": await offload(echo_logprobs, i, out),
                                                        "finish_reason": None}]}
                        base = len(echoed(i, out)) if req.echo else 0  # offsets run on after the echo
                        lp = choice_logprobs(c, d.token_start, d.token_end, base)
                        # A chunk for every output with new tokens, text or not (held back for a stop string, or
                        # bytes of a character not complete yet), as vLLM streams: clients count tokens by chunks.
                        if d.text or c.finished or lp or d.token_end > d.token_start:
                            yield {**head, "choices": [{"index": idx, "text": d.text, "logprobs": lp,
                                                        "finish_reason": c.finish_reason,
                                                        "stop_reason": c.stop_reason}]}
                    if out.finished:
                        usage["prompt"] += len(out.prompt_token_ids)
                        usage["completion"] += sum(len(c.token_ids) for c in out.outputs)
            if include_usage:
                yield {**head, "choices": [], "usage": {"prompt_tokens": usage["prompt"],
                                                        "completion_tokens": usage["completion"],
                                                        "total_tokens": usage["prompt"] + usage["completion"]}}

        return StreamingResponse(pipeline.sse_events(chunks()), media_type="text/event-stream")

    return api


# -- echo with max_tokens 0: the prompt scored, nothing generated ------------------------------------------------------
def scoring_params(req: CompletionRequest) -> SamplingParams:
    """The engine request that scores a prompt: one greedy token, sampled from the prefill's last row and never
    returned, so the prefill is the only step (no decode step runs); the prompt's logprobs come from the prefill's
    rows exactly as for any echo, the sampled token's row is not one of them. One sequence whatever ``n`` is: the n
    choices are the same prompt. The request's sampling fields are still checked as any request's (a 400 naming
    the field), though nothing is generated for them to shape."""
    if req.min_tokens:
        raise bad_request("min_tokens must be between 0 and max_tokens (0: echo with max_tokens 0 scores the prompt, "
                          "nothing is generated)", "min_tokens")
    pipeline.request_params(req, 1, req.logprobs)
    k = req.prompt_logprobs if req.prompt_logprobs is not None else req.logprobs
    return SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=k, detokenize=False)


async def score_prompts(state: ServerState, req: CompletionRequest, request: Request, prompts: list[list[int]],
                        texts: list[str | None], lora: LoRAAdapter | None) -> Any:
    """``echo`` with ``max_tokens: 0`` (OpenAI's legacy API, vLLM): per prompt, ``n`` choices whose text is the
    prompt, with its logprobs when ``logprobs`` is given (vLLM's ``prompt_logprobs`` too, unstreamed),
    ``finish_reason`` "length", no completion tokens; streamed, one chunk per choice."""
    for ids in prompts:
        pipeline.check_length(state, len(ids), 1)  # the discarded token needs its place in the context
    params = scoring_params(req)
    rid = req.request_id or new_id("cmpl")
    head = {"id": rid, "object": "text_completion", "created": now(), "model": req.model or state.model_name}
    merged = pipeline.start(state, prompts, texts, params, lora, rid)
    tok = state.tokenizer

    def choices(i: int, out: RequestOutput, with_prompt_logprobs: bool) -> list[dict[str, Any]]:
        text = texts[i] or tok.decode(out.prompt_token_ids)
        lps = None if req.logprobs is None or out.prompt_logprobs is None else \
            prompt_completion_logprobs(tok, out.prompt_token_ids, out.prompt_logprobs[1:], len(text))
        extra = {"prompt_logprobs": vllm_prompt_logprobs(tok, out.prompt_logprobs)} \
            if with_prompt_logprobs and req.prompt_logprobs is not None else {}
        return [{"index": i * req.n + j, "text": text, "logprobs": lps, "finish_reason": "length",
                 "stop_reason": None, **extra} for j in range(req.n)]

    def usage(prompt_tokens: int) -> dict[str, int]:
        return {"prompt_tokens": prompt_tokens, "completion_tokens": 0, "total_tokens": prompt_tokens}

    if not req.stream:
        finals = await pipeline.collect(state, request, merged, len(prompts))
        scored = [c for i, out in enumerate(finals) for c in await offload(choices, i, out, True)]
        return {**head, "choices": scored, "usage": usage(sum(len(out.prompt_token_ids) for out in finals))}

    async def chunks() -> AsyncGenerator[dict[str, Any], None]:
        prompt_tokens = 0
        async with aclosing(merged):
            async for i, out in merged:
                if out.finished:
                    prompt_tokens += len(out.prompt_token_ids)
                    for choice in await offload(choices, i, out, False):
                        yield {**head, "choices": [choice]}
        if req.stream_options and req.stream_options.include_usage:
            yield {**head, "choices": [], "usage": usage(prompt_tokens)}

    return StreamingResponse(pipeline.sse_events(chunks()), media_type="text/event-stream")
