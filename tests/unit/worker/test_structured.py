"""Constrained decoding: grammar masks against a reference matcher, the compiled-grammar cache, and a batch in
which constrained and free requests each get their own tokens."""

from __future__ import annotations

import json
import random

import pytest
import regex
import torch

from keepwarm.worker.engine.sequence import Sequence
from keepwarm.worker.sampler import Sampler
from keepwarm.worker.sampling_params import SamplingParams
from keepwarm.worker.structured import (
    GrammarCompiler,
    GrammarError,
    StructuredOutputs,
    token_bytes,
    unpack_bitmask,
)


# -- a reference matcher over the SmolLM2 tokenizer ---------------------------------------------------------------
@pytest.fixture(scope="module")
def smollm2():
    from keepwarm.worker.default_model import default_model
    from keepwarm.worker.tokenizer import load_tokenizer

    tok = load_tokenizer(default_model())
    vocab = tok.vocab_size
    tb = token_bytes(tok.backend_tokenizer.to_str())
    eos = tok.backend_tokenizer.token_to_id("<|im_end|>")
    compiler = GrammarCompiler.for_tokenizer(tok, vocab, (eos,), cache_size=4)
    return tok, tb, eos, compiler


def allowed_set(matcher, vocab: int) -> set[int]:
    row = torch.zeros(1, (vocab + 31) // 32, dtype=torch.int32)
    matcher.fill_bitmask(row[0])
    return set(torch.nonzero(unpack_bitmask(row, vocab)[0]).flatten().tolist())


class FiniteLanguage:
    """The exact set of valid outputs: a prefix is viable if some member starts with it."""

    def __init__(self, members: list[str]) -> None:
        self.members = [m.encode() for m in members]

    def viable(self, prefix: bytes) -> bool:
        return any(m.startswith(prefix) for m in self.members)

    def complete(self, text: bytes) -> bool:
        return text in self.members


class RegexLanguage:
    """Python's `regex` with partial matching: a prefix is viable if it can still be extended to a full match."""

    def __init__(self, pattern: str) -> None:
        self.pattern = regex.compile(pattern)

    def viable(self, prefix: bytes) -> bool:
        try:
            text = prefix.decode("ascii")  # the test patterns are ASCII: any other byte leaves the language
        except UnicodeDecodeError:
            return False
        return self.pattern.fullmatch(text, partial=True) is not None

    def complete(self, text: bytes) -> bool:
        return self.viable(text) and self.pattern.fullmatch(text.decode()) is not None


def check_walk(matcher, tokens_bytes, eos: int, lang, path: list[int], vocab: int) -> bytes:
    """Follow ``path``; at every step every allowed token keeps the output viable (EOS only where it is complete)
    and the path's next token is allowed. Returns the text. (Where thousands of tokens are allowed, e.g. inside
    ``[a-z]+``, a seeded sample of 100 of them is checked, to keep the test fast.)"""
    text = b""
    rng = random.Random(1)
    for t in path:
        allowed = allowed_set(matcher, vocab)
        assert t in allowed, f"canonical token {t} ({tokens_bytes[t]!r}) refused after {text!r}"
        checked = allowed if len(allowed) <= 100 else {eos} | set(rng.sample(sorted(allowed), 100))
        for a in checked & allowed:
            if a == eos:
                assert lang.complete(text), f"EOS allowed after the incomplete {text!r}"
            else:
                assert tokens_bytes[a] is not None and lang.viable(text + tokens_bytes[a]), \
                    f"token {a} ({tokens_bytes[a]!r}) allowed after {text!r} leaves the language"
        assert matcher.accept(t)
        text += tokens_bytes[t]
    return text


CASES = {
    "choice": (StructuredOutputs("choice", ["yes", "no", "not sure", "n/a"]),
               FiniteLanguage(["yes", "no", "not sure", "n/a"])),
    "regex": (StructuredOutputs("regex", r"[0-9]{2,4}-(red|green) [a-z]+"),
              RegexLanguage(r"[0-9]{2,4}-(red|green) [a-z]+")),
    "json": (StructuredOutputs("json", {
        "type": "object", "additionalProperties": False, "required": ["color", "ok"],
        "properties": {"color": {"enum": ["red", "green"]}, "ok": {"type": "boolean"}}}),
        FiniteLanguage([json.dumps({"color": c, "ok": ok}) for c in ("red", "green") for ok in (True, False)])),
}
SAMPLES = {"choice": ["yes", "no", "not sure", "n/a"], "regex": ["12-red apple", "2026-green tea"],
           "json": CASES["json"][1].members}


@pytest.mark.parametrize("case", list(CASES))
def test_mask_against_reference(smollm2, case: str) -> None:
    tok, token_bytes, eos, compiler = smollm2
    spec, lang = CASES[case]
    compiled = compiler.compile(spec)
    vocab = len(token_bytes)
    # Every member (its canonical tokens) can be produced, and nothing the mask allows on the way leaves the language.
    for sample in SAMPLES[case]:
        sample = sample.decode() if isinstance(sample, bytes) else sample
        m = compiled.matcher()
        text = check_walk(m, token_bytes, eos, lang, tok.encode(sample, add_special_tokens=False), vocab)
        assert text == sample.encode()
        assert eos in allowed_set(m, vocab)
    # Random walks through whatever the mask allows end in the language.
    rng = random.Random(0)
    for _ in range(4):
        m = compiled.matcher()
        path: list[int] = []
        text = b""
        while not m.is_stopped and len(path) < 24:
            allowed = sorted(allowed_set(m, vocab) - {eos})
            if not allowed:
                break
            t = rng.choice(allowed)
            path.append(t)
            text += token_bytes[t]
            m.accept(t)
        check_walk(compiled.matcher(), token_bytes, eos, lang, path, vocab)
        assert lang.complete(text) or len(path) == 24, f"walk ended at {text!r}, outside the language"


def test_objects_are_closed_unless_the_schema_says_otherwise(smollm2) -> None:
    tok, token_bytes, eos, compiler = smollm2
    vocab = len(token_bytes)
    closed = compiler.compile(StructuredOutputs("json", {"type": "object", "properties": {"a": {"type": "integer"}},
                                                         "required": ["a"]}))
    open_ = compiler.compile(StructuredOutputs("json", {"type": "object", "properties": {"a": {"type": "integer"}},
                                                        "required": ["a"], "additionalProperties": True}))
    for compiled, comma_allowed in ((closed, False), (open_, True)):
        m = compiled.matcher()
        for t in tok.encode('{"a": 1', add_special_tokens=False):
            assert m.accept(t)
        comma = tok.encode(",", add_special_tokens=False)[0]
        assert (comma in allowed_set(m, vocab)) == comma_allowed


def test_json_object_and_invalid_specs(smollm2) -> None:
    _tok, _tb, _eos, compiler = smollm2
    compiler.compile(StructuredOutputs("json_object", None))
    with pytest.raises(GrammarError, match="objectx") as e:
        compiler.compile(StructuredOutputs("json", {"type": "objectx"}, field="response_format"))
    assert e.value.field == "response_format"
    with pytest.raises(GrammarError, match="regex"):
        compiler.compile(StructuredOutputs("regex", "([a-z"))
    with pytest.raises(GrammarError, match="choice"):
        compiler.compile(StructuredOutputs("choice", []))
    with pytest.raises(GrammarError, match="JSON"):
        compiler.compile(StructuredOutputs("json", "{not json"))


def test_compiled_grammars_are_cached_and_bounded(smollm2) -> None:
    _tok, _tb, _eos, compiler = smollm2
    specs = [StructuredOutputs("regex", f"[a-z]{{{i}}}") for i in range(1, 7)]
    first = compiler.compile(specs[0])
    hits = compiler.hits
    assert compiler.compile(StructuredOutputs("regex", "[a-z]{1}")) is first
    assert compiler.hits == hits + 1
    for s in specs:
        compiler.compile(s)
    assert compiler.cache_len == compiler.cache_size == 4
    assert compiler.compile(specs[0]) is not first  # evicted (least recently used), compiled again


# -- the sampler ---------------------------------------------------------------------------------------------------
def test_sampler_masks_only_constrained_rows(smollm2) -> None:
    _tok, token_bytes, eos, compiler = smollm2
    vocab = len(token_bytes)
    compiled = compiler.compile(StructuredOutputs("choice", ["yes", "no"]))
    torch.manual_seed(0)
    logits = torch.randn(4, vocab)
    seqs = [Sequence(f"m{i}", [1], SamplingParams(temperature=0.0, structured=compiled if i % 2 else None))
            for i in range(4)]
    before = logits.clone()
    out = Sampler().sample(logits, seqs)
    assert torch.equal(logits, before)  # the caller's tensor is untouched
    allowed = allowed_set(compiled.matcher(), vocab)
    for i, t in enumerate(out.token_ids):
        if i % 2:
            assert t == max(allowed, key=lambda a: before[i, a].item())
        else:
            assert t == before[i].argmax().item()


def test_grammar_wins_over_min_tokens(smollm2) -> None:
    """Once only EOS is valid, min_tokens cannot leave the row empty: the grammar's EOS is sampled."""
    _tok, token_bytes, eos, compiler = smollm2
    compiled = compiler.compile(StructuredOutputs("regex", "ab?"))
    s = Sequence("x", [1], SamplingParams(temperature=0.0, min_tokens=5, structured=compiled))
    for t in _tok.encode("ab", add_special_tokens=False):
        s.grammar.accept(t)
        s.append_token(t)
    out = Sampler().sample(torch.randn(1, len(token_bytes)), [s])
    assert out.token_ids == [eos]


# -- the engine: constrained and free requests in one batch --------------------------------------------------------
def test_mixed_batch_free_requests_equal_an_unconstrained_run(tiny_llama) -> None:
    from keepwarm.worker.llm import LLM

    llm = LLM(model=tiny_llama, dtype="float32", max_model_len=256, enable_prefix_caching=False)
    free_prompts = ["The quick brown fox", "Serving large language models", "Numbers like 12345"]
    free = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    alone = [o.outputs[0].token_ids for o in llm.generate(free_prompts, free)]

    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                               "n": {"type": "integer"}},
              "required": ["name", "n"], "additionalProperties": False}
    constrained = [
        ("A paged key", SamplingParams(temperature=0.0, max_tokens=40,
                                       structured=StructuredOutputs("choice", ["red", "green", "blue"]))),
        ("Prefix caching", SamplingParams(temperature=0.8, seed=3, n=2, max_tokens=40,
                                          structured=StructuredOutputs("regex", r"[0-9]{3}-(yes|no)"))),
        ("Once upon", SamplingParams(temperature=0.0, max_tokens=60, structured=StructuredOutputs("json", schema))),
    ]
    prompts = [free_prompts[0], constrained[0][0], free_prompts[1], constrained[1][0], constrained[2][0],
               free_prompts[2]]
    params = [free, constrained[0][1], free, constrained[1][1], constrained[2][1], free]
    outs = llm.generate(prompts, params)
    assert [outs[i].outputs[0].token_ids for i in (0, 2, 5)] == alone
    assert outs[1].outputs[0].text in ("red", "green", "blue")
    assert outs[1].outputs[0].finish_reason == "stop"
    for c in outs[3].outputs:
        assert regex.fullmatch(r"[0-9]{3}-(yes|no)", c.text), c.text
    obj = json.loads(outs[4].outputs[0].text)
    assert set(obj) == {"name", "n"} and isinstance(obj["n"], int) and isinstance(obj["name"], str)
