"""POST /tokenize and /detokenize, in vLLM's shapes (a prompt, or chat messages through the template)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from keepwarm.worker.http import pipeline
from keepwarm.worker.http.limits import check_prompt_chars, offload
from keepwarm.worker.http.state import ServerState
from keepwarm.worker.openai.protocol import DetokenizeRequest, TokenizeRequest, bad_request


def router(state: ServerState) -> APIRouter:
    api = APIRouter()

    @api.post("/tokenize")
    async def tokenize(req: TokenizeRequest) -> dict[str, Any]:
        pipeline.resolve_model(state, req.model)
        tok = state.tokenizer
        if (req.prompt is None) == (req.messages is None):
            raise bad_request("give exactly one of prompt and messages", "prompt")
        if req.prompt is None:
            ids = await pipeline.render_chat(state, req)
        else:
            prompt = req.prompt
            check_prompt_chars(len(prompt), state.engine.max_model_len, state.token_chars, "prompt")
            ids = await offload(tok.encode, prompt, add_special_tokens=req.add_special_tokens)
        return {"count": len(ids), "max_model_len": state.engine.max_model_len, "tokens": ids,
                "token_strs": [tok.convert_ids_to_tokens(t) for t in ids] if req.return_token_strs else None}

    @api.post("/detokenize")
    async def detokenize(req: DetokenizeRequest) -> dict[str, str]:
        pipeline.resolve_model(state, req.model)
        vocab = state.engine.model_config.vocab_size
        state.budget.check_prompt_tokens(len(req.tokens), "tokens")  # as a request's prompts: bounded
        if any(t < 0 or t >= vocab for t in req.tokens):
            raise bad_request(f"token ids must be in [0, {vocab})", "tokens")
        return {"prompt": await offload(state.tokenizer.decode, req.tokens)}

    return api
