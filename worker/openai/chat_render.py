"""Chat messages -> the prompt's text, through the model's chat template (chat, /tokenize and /v1/responses).

Text content parts are joined; other part types are a 400. An assistant message's ``tool_calls`` (arguments as
objects, as Hugging Face templates expect) and a tool message's ``tool_call_id`` and ``name`` reach the template;
the request's ``tools`` are passed as the template's ``tools``. A template error is a 400 naming ``messages`` (or
``chat_template``). A request's own ``chat_template`` needs ``--trust-request-chat-template``. The HTTP front runs
this off the event loop, after checking the messages' characters (keepwarm.worker.http.pipeline.render_chat); the
tokenizer renders sandboxed, bounded in time and size (keepwarm.worker.tokenizer).
"""

from __future__ import annotations

from typing import Any

from keepwarm.worker.openai.protocol import APIError, bad_request
from keepwarm.worker.openai.tool_calls import template_messages

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


def check_template(req: Any, trusted: bool) -> None:
    """A request's own ``chat_template`` only with ``--trust-request-chat-template`` (``trusted``): else a 400."""
    if req.chat_template is not None and not trusted:
        raise bad_request("a request's own chat_template is refused unless the server runs with "
                          "--trust-request-chat-template", "chat_template")


def prompt_ids(tok: Any, req: Any, messages: list[dict[str, Any]]) -> list[int]:
    """The token ids of ``messages`` rendered with the request's template settings (and ``tools``); CPU work, run
    off the event loop. Raises what the template or the tokenizer raise (``template_error`` names it)."""
    kwargs = dict(req.chat_template_kwargs or {})
    if req.tools:
        kwargs["tools"] = req.tools
    text = tok.apply_chat_template(messages, chat_template=req.chat_template, tokenize=False,
                                   add_generation_prompt=req.add_generation_prompt and not req.continue_final_message,
                                   continue_final_message=req.continue_final_message, **kwargs)
    return tok.encode(text, add_special_tokens=False)


def template_error(e: Exception, req: Any) -> APIError:
    """The 400 for a template that failed (jinja errors, time/size limits, a missing template)."""
    return bad_request(f"cannot apply the chat template: {' '.join(str(e).split())}",
                       "chat_template" if req.chat_template is not None else "messages")
