"""A small tokenizer over `tokenizers` + jinja2, for the serving path.

transformers' AutoTokenizer costs ~1 s to import and ~1 s to load SmolLM2's tokenizer on this machine: most of a
warm restart. A model directory with `tokenizer.json` needs neither: the `tokenizers` library does the encoding
and decoding (transformers' fast tokenizers are the same library underneath) and jinja2 renders the chat template
the way transformers does (sandboxed, trim_blocks, lstrip_blocks, loop controls, `raise_exception`,
`strftime_now`). Directories without `tokenizer.json` (slow tokenizers) still go through AutoTokenizer.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any


class TokenizerError(ValueError):
    pass


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):  # transformers' serialized AddedToken
        return value.get("content")
    return value


class FastTokenizer:
    """The subset of a transformers tokenizer keepwarm uses: encode, decode, apply_chat_template, special ids."""

    def __init__(self, model_dir: str | Path) -> None:
        from tokenizers import Tokenizer

        d = Path(model_dir)
        self.name_or_path = str(d)
        self.backend_tokenizer = Tokenizer.from_file(str(d / "tokenizer.json"))
        cfg_path = d / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        template = cfg.get("chat_template")
        if isinstance(template, list):  # named templates: use the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        jinja_file = d / "chat_template.jinja"
        if template is None and jinja_file.is_file():
            template = jinja_file.read_text()
        self.chat_template: str | None = template
        self.bos_token = _token_text(cfg.get("bos_token"))
        self.eos_token = _token_text(cfg.get("eos_token"))
        self.pad_token = _token_text(cfg.get("pad_token"))
        self.unk_token = _token_text(cfg.get("unk_token"))
        self._compiled: dict[str, Any] = {}

    def _id(self, token: str | None) -> int | None:
        return None if token is None else self.backend_tokenizer.token_to_id(token)

    @property
    def eos_token_id(self) -> int | None:
        return self._id(self.eos_token)

    @property
    def bos_token_id(self) -> int | None:
        return self._id(self.bos_token)

    @property
    def pad_token_id(self) -> int | None:
        return self._id(self.pad_token)

    @property
    def vocab_size(self) -> int:
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend_tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.backend_tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, token_id: int) -> str | None:
        return self.backend_tokenizer.id_to_token(token_id)

    def _template(self, source: str):
        if source not in self._compiled:
            from jinja2.ext import loopcontrols
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            def raise_exception(message: str) -> None:
                raise TokenizerError(message)

            def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None,
                       sort_keys: bool = False) -> str:
                return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                                  sort_keys=sort_keys)

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
            env.filters["tojson"] = tojson
            env.globals["raise_exception"] = raise_exception
            env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
            self._compiled[source] = env.from_string(source)
        return self._compiled[source]

    def apply_chat_template(self, messages: list[dict[str, Any]], chat_template: str | None = None,
                            tokenize: bool = True, add_generation_prompt: bool = False,
                            continue_final_message: bool = False, **kwargs: Any) -> str | list[int]:
        source = chat_template or self.chat_template
        if source is None:
            raise TokenizerError("this tokenizer has no chat template")
        text = self._template(source).render(
            messages=messages, add_generation_prompt=add_generation_prompt, bos_token=self.bos_token or "",
            eos_token=self.eos_token or "", pad_token=self.pad_token or "", unk_token=self.unk_token or "",
            **kwargs)
        if continue_final_message and messages:
            final = messages[-1].get("content") or ""
            if isinstance(final, str) and final.strip() and final.strip() in text:
                # transformers cuts everything after the final message's content, so generation continues it.
                text = text[:text.rindex(final.strip()) + len(final.strip())]
        return self.encode(text, add_special_tokens=False) if tokenize else text


def gguf_tokenizer_dir(path: Path) -> Path:
    """A directory with the tokenizer of a .gguf file: the file's own directory when it holds tokenizer.json,
    else one converted once from the GGUF metadata (transformers' GGUF tokenizer) under $KEEPWARM_HOME/tokenizers,
    keyed by the file's name, size and mtime."""
    if (path.parent / "tokenizer.json").is_file():
        return path.parent
    import fcntl
    import hashlib
    import os
    import shutil
    import tempfile

    from keepwarm.formats.paths import keepwarm_home

    st = path.stat()
    key = hashlib.sha256(f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:16]
    target = keepwarm_home() / "tokenizers" / f"{path.stem}-{key}"
    if (target / "tokenizer.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (target / "tokenizer.json").is_file():
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
            tmp = Path(tempfile.mkdtemp(prefix=".tok-", dir=target.parent))
            tok.save_pretrained(tmp)
            os.replace(tmp, target) if not target.exists() else shutil.rmtree(tmp)
    return target


def load_tokenizer(path: str | Path):
    """FastTokenizer when the directory has tokenizer.json, else transformers' AutoTokenizer; for a .gguf file,
    the tokenizer beside it or converted from its metadata (see gguf_tokenizer_dir)."""
    p = Path(path)
    if p.suffix == ".gguf" and p.is_file():
        p = gguf_tokenizer_dir(p)
    if (p / "tokenizer.json").is_file():
        return FastTokenizer(p)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(p))
