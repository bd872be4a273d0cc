"""Chat messages -> the prompt's token ids, through the model's chat template (shared by chat, /tokenize and
/v1/responses).

Text content parts are joined; other part types are a 400. An assistant message's ``tool_calls`` (arguments as
objects, as Hugging Face templates expect) and a tool message's ``tool_call_id`` and ``name`` reach the template;
the request's ``tools`` are passed as the template's ``tools``. A template error is a 400 naming ``messages`` (or
``chat_template``). Issue 17's bounds hold here: a request's own ``chat_template`` needs
``--trust-request-chat-template``; the messages' characters are checked before tokenizing; rendering and
tokenizing run off the event loop, sandboxed and bounded in time and size (keepwarm.worker.tokenizer).
"""

from __future__ import annotations

from typing import Any

from keepwarm.worker.api.limits import check_prompt_chars, offload
from keepwarm.worker.api.protocol import bad_request
from keepwarm.worker.api.state import ServerState
from keepwarm.worker.api.tool_calls import template_messages

PASSED_THROUGH = ("tool_calls", "tool_call_id", "name")


def message_dicts(messages: list[Any]) -> list[dict[str, Any]]:
    out = []
    for m in messages:
        content = m.content
        if isinstance(content, list):
            parts = []
            for part in content:
                if part.get("type") not in ("text", "input_text", "output_text") or \
                        not isinstance(part.get("text"), str):
                    raise bad_request("only text content parts are supported", "messages")
                parts.append(part["text"])
            content = "".join(parts)
        d: dict[str, Any] = {"role": m.role, "content": content or ""}
        extra = {**(m.model_extra or {}), "name": m.name}
        for key in PASSED_THROUGH:
            if extra.get(key) is not None:
                d[key] = extra[key]
        out.append(d)
    return template_messages(out)


async def render_chat(state: ServerState, req: Any) -> list[int]:
    """The prompt ids of a chat (or chat-shaped /tokenize, or /v1/responses) request; 400 naming what is wrong."""
    if req.chat_template is not None and not state.config.trust_request_chat_template:
        raise bad_request("a request's own chat_template is refused unless the server runs with "
                          "--trust-request-chat-template", "chat_template")
    messages = message_dicts(req.messages)
    check_prompt_chars(sum(len(m["content"]) for m in messages), state.engine.max_model_len, state.token_chars,
                       "messages")
    kwargs = dict(req.chat_template_kwargs or {})
    if req.tools:
        kwargs["tools"] = req.tools
    tok = state.tokenizer

    def render() -> list[int]:
        text = tok.apply_chat_template(messages, chat_template=req.chat_template, tokenize=False,
                                       add_generation_prompt=req.add_generation_prompt and
                                       not req.continue_final_message,
                                       continue_final_message=req.continue_final_message, **kwargs)
        return tok.encode(text, add_special_tokens=False)

    try:
        return await offload(render)
    except Exception as e:  # jinja errors, time/size limits, missing template
        raise bad_request(f"cannot apply the chat template: {' '.join(str(e).split())}",
                          "chat_template" if req.chat_template is not None else "messages") from None
