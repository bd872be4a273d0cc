"""Which grammar engine keepwarm uses: mask time per token of xgrammar, llguidance and outlines-core on the CPU.

Run once, in a scratch venv outside the repository (the losers are not project dependencies)::

    python3 -m venv /tmp/gscratch && /tmp/gscratch/bin/pip install torch==2.13.0 \
        xgrammar llguidance outlines-core tokenizers transformers
    OMP_NUM_THREADS=1 /tmp/gscratch/bin/python benchmarks/grammar_engines.py \
        ~/.local/share/keepwarm/models/SmolLM2-135M-Instruct

For each engine and grammar: the compile time (first use, the cache's miss) and the time to compute one
next-token mask over the full vocabulary (SmolLM2: 49,152 tokens) plus advancing the matcher by the token, walking
the tokens of a valid document (the median and p99 over its tokens). Each engine's mask is checked against the
others' at every step: equal allowed sets, or the difference is printed.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import torch

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "email": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                    "required": ["city", "zip"], "additionalProperties": False},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "email", "tags", "address", "active"],
    "additionalProperties": False,
}
DOC = json.dumps({"name": "Ada Lovelace", "age": 36, "email": "ada@example.org", "tags": ["math", "engines"],
                  "address": {"city": "London", "zip": "W1"}, "active": True}, separators=(", ", ": "))
REGEX = r"\d{3}-\d{4} [A-Z][a-z]+"
REGEX_DOC = "555-1234 Smith"


def byte_vocab(tokenizer_json: str) -> list[bytes]:
    """Each token's bytes, by keepwarm's own helper (loaded from its file: the scratch venv lacks keepwarm)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("kw_structured", Path(__file__).parents[1] / "worker" /
                                                  "structured.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return [b or b"" for b in mod.token_bytes(tokenizer_json)]


class XGrammar:
    name = "xgrammar"

    def __init__(self, model_dir: Path, vocab: int, eos: int) -> None:
        import xgrammar as xgr
        from transformers import AutoTokenizer

        self.xgr = xgr
        info = xgr.TokenizerInfo.from_huggingface(AutoTokenizer.from_pretrained(model_dir), vocab_size=vocab,
                                                  stop_token_ids=[eos])
        self.compiler = xgr.GrammarCompiler(info, max_threads=1)
        self.vocab = vocab

    def compile(self, kind: str, spec: str):
        return (self.compiler.compile_json_schema(spec, any_whitespace=False) if kind == "json"
                else self.compiler.compile_regex(spec))

    def matcher(self, compiled):
        m = self.xgr.GrammarMatcher(compiled)
        bitmask = self.xgr.allocate_token_bitmask(1, self.vocab)

        def mask() -> torch.Tensor:
            m.fill_next_token_bitmask(bitmask)
            return bitmask[0]

        def advance(t: int) -> None:
            if not m.accept_token(t):
                raise RuntimeError(f"xgrammar rejected token {t}")

        return mask, advance


class LLGuidance:
    name = "llguidance"

    def __init__(self, model_dir: Path, vocab: int, eos: int) -> None:
        import llguidance
        import llguidance.torch as llt

        self.ll, self.llt = llguidance, llt
        self.tok = llguidance.LLTokenizer((model_dir / "tokenizer.json").read_text(), n_vocab=vocab, eos_token=eos)
        self.vocab = vocab

    def compile(self, kind: str, spec: str):
        g = (self.ll.LLMatcher.grammar_from_json_schema(
            spec, defaults={"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "})
             if kind == "json" else self.ll.LLMatcher.grammar_from_regex(spec))
        m = self.ll.LLMatcher(self.tok, g)  # llguidance compiles lazily: the first mask does the work
        self.llt.fill_next_token_bitmask(m, self.llt.allocate_token_bitmask(1, self.vocab), 0)
        return g

    def matcher(self, compiled):
        m = self.ll.LLMatcher(self.tok, compiled)
        bitmask = self.llt.allocate_token_bitmask(1, self.vocab)

        def mask() -> torch.Tensor:
            self.llt.fill_next_token_bitmask(m, bitmask, 0)
            return bitmask[0]

        def advance(t: int) -> None:
            if not m.consume_token(t):
                raise RuntimeError(f"llguidance rejected token {t}: {m.get_error()}")

        return mask, advance


class OutlinesCore:
    name = "outlines-core"

    def __init__(self, model_dir: Path, vocab: int, eos: int) -> None:
        import outlines_core
        from outlines_core.kernels.torch import allocate_token_bitmask, fill_next_token_bitmask

        self.oc, self.alloc, self.fill = outlines_core, allocate_token_bitmask, fill_next_token_bitmask
        groups: dict[bytes, list[int]] = {}
        for i, b in enumerate(byte_vocab((model_dir / "tokenizer.json").read_text())):
            if i != eos and b:
                groups.setdefault(b, []).append(i)
        self.vocabulary = outlines_core.Vocabulary(eos, groups)
        self.vocab = vocab

    def compile(self, kind: str, spec: str):
        regex = self.oc.json_schema.build_regex_from_schema(spec, r"[ ]?") if kind == "json" else spec
        return self.oc.Index(regex, self.vocabulary)

    def matcher(self, compiled):
        g = self.oc.Guide(compiled)
        bitmask = self.alloc(self.vocab)

        def mask() -> torch.Tensor:
            self.fill(g, bitmask)
            return bitmask[0]

        return mask, g.advance


def allowed(bitmask: torch.Tensor, vocab: int) -> set[int]:
    bits = ((bitmask[:, None] >> torch.arange(32)) & 1).flatten()[:vocab]
    return set(torch.nonzero(bits).flatten().tolist())


def main() -> None:
    from tokenizers import Tokenizer

    torch.set_num_threads(1)
    model_dir = Path(sys.argv[1])
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    vocab = tok.get_vocab_size(with_added_tokens=True)
    eos = tok.token_to_id("<|im_end|>")
    print(f"vocabulary {vocab} tokens; torch threads 1")
    cases = [("json", json.dumps(SCHEMA), DOC), ("regex", REGEX, REGEX_DOC)]
    reference: dict[str, list[set[int]]] = {}
    for cls in (XGrammar, LLGuidance, OutlinesCore):
        t0 = time.perf_counter()
        eng = cls(model_dir, vocab, eos)
        setup = time.perf_counter() - t0
        for kind, spec, doc in cases:
            t0 = time.perf_counter()
            compiled = eng.compile(kind, spec)
            compile_s = time.perf_counter() - t0
            ids = tok.encode(doc, add_special_tokens=False).ids
            times, sets = [], []
            for _rep in range(5):
                mask, advance = eng.matcher(compiled)
                for t in ids:
                    t0 = time.perf_counter()
                    bm = mask()
                    advance(t)
                    times.append(time.perf_counter() - t0)
                    if _rep == 0:
                        sets.append(allowed(bm, vocab))
            ref = reference.setdefault(kind, sets)
            diff = sum(1 for a, b in zip(ref, sets, strict=True) if a != b)
            times.sort()
            print(f"{eng.name:14s} {kind:5s} setup {setup:6.2f}s compile {compile_s * 1e3:8.1f} ms  mask+advance "
                  f"median {statistics.median(times) * 1e6:7.1f} us  p99 {times[int(len(times) * 0.99)] * 1e6:7.1f} "
                  f"us over {len(ids)} tokens x5; steps whose allowed set differs from xgrammar's: {diff}")


if __name__ == "__main__":
    main()
