"""The offline API in vLLM's shapes (issue 46, point 7): code written for ``vllm.LLM`` runs unchanged.

tests/data/vllm_offline_snippet.py is written against vLLM's documented API; it runs here in a subprocess with its
one import line changed, on the tiny random Llama and its tokenizer. Its logprobs are checked against the rules
(vLLM's: the sampled token first, ranks 1-based, top-k ranked 1..k, decoded tokens as the tokenizer decodes them,
pieces of a multi-byte character completed by the tokens before them, cumulative_logprob the sum) and against
transformers' own log-softmax of the same model. The conversion from the engine's TokenLogprob is also checked on
its own, where the sampled token falls outside the top-k. (Run by hand under vLLM 0.32 CPU on the same tiny model,
the snippet printed the same token ids, ranks, dict order and decoded tokens, and logprobs within 2e-5.)
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from keepwarm.worker.llm import completed_text, space_marker, token_decoder
from keepwarm.worker.outputs import (
    CompletionOutput,
    Logprob,
    RequestMetrics,
    RequestOutput,
    TokenLogprob,
    context_of,
    to_vllm_output,
    vllm_position,
)

SNIPPET = Path(__file__).resolve().parents[2] / "data" / "vllm_offline_snippet.py"
VLLM_IMPORT = "from vllm import LLM, SamplingParams"


@pytest.fixture(scope="module")
def snippet_run(tiny_llama, tmp_path_factory) -> list[dict]:
    """The snippet's JSON record, run with ``from keepwarm import`` in place of ``from vllm import`` (only)."""
    source = SNIPPET.read_text()
    assert source.splitlines().count(VLLM_IMPORT) == 1  # the one line that changes
    script = tmp_path_factory.mktemp("snippet") / "snippet.py"
    script.write_text(source.replace(VLLM_IMPORT, "from keepwarm import LLM, SamplingParams"))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, str(script), tiny_llama], capture_output=True, text=True, env=env,
                         timeout=300, check=False)
    assert run.returncode == 0, run.stderr[-4000:]
    lines = run.stdout.strip().splitlines()
    assert lines[0].startswith("Prompt: 'Hello, my name is', Generated text: ")
    assert lines[1].startswith("Prompt: 'The capital of France is', Generated text: ")
    return json.loads(lines[-1])


@pytest.fixture(scope="module")
def reference(tiny_llama):
    """transformers' model and tokenizer for the same directory: (log-softmax of ids, decode of one id)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    tok = transformers.AutoTokenizer.from_pretrained(tiny_llama)

    def log_softmax(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)

    return log_softmax, tok


def check_text(decoded: str, token_id: int, context: list[int], tok, seen: set[str]) -> None:
    """``decoded_token``: the tokenizer's decode of the token alone, unless that ends in U+FFFD (a piece of a
    multi-byte character): then "" or the text that decoding it after some of ``context`` (the chosen tokens of
    the positions before, at most 4) ends with. ``seen`` collects which case it was."""
    alone = tok.decode([token_id])
    if not alone.endswith("\ufffd"):
        assert decoded == alone
        seen.add("alone")
        return
    assert not decoded.endswith("\ufffd") and len(context) <= 4
    if decoded == "":
        seen.add("incomplete")
        return
    assert any(tok.decode(context[-n:] + [token_id]).endswith(decoded) for n in range(1, len(context) + 1))
    seen.add("completed")


def check_position(candidates: list, token_id: int, k: int, ref: torch.Tensor, tok, context: list[int],
                   seen: set[str]) -> None:
    """One position's {id: Logprob} (as [id, logprob, rank, decoded] rows) against vLLM's rules and ``ref`` (the
    reference log-softmax that predicts it)."""
    ids = [c[0] for c in candidates]
    assert ids[0] == token_id and len(set(ids)) == len(ids)  # the chosen token first, each id once
    chosen_rank = int((ref > ref[token_id]).sum()) + 1
    top = ref.topk(k)
    # the top-k ranked 1..k; the chosen token adds an entry only when it is outside them
    assert len(candidates) == k + (chosen_rank > k)
    assert sorted(c[2] for c in candidates) == sorted({*range(1, k + 1), chosen_rank})
    by_rank = sorted(candidates, key=lambda c: c[2])
    assert [c[0] for c in by_rank[:k]] == top.indices.tolist()
    for c in candidates:
        assert c[1] == pytest.approx(ref[c[0]].item(), abs=1e-4)
        check_text(c[3], c[0], context, tok, seen)
    assert candidates[0][2] == chosen_rank


def test_snippet_greedy_logprobs(snippet_run, reference) -> None:
    log_softmax, tok = reference
    seen: set[str] = set()
    for rec in snippet_run[:2]:
        assert rec["finished"] and rec["index"] == 0 and rec["finish_reason"] in ("stop", "length")
        assert rec["prompt_token_ids"] == tok.encode(rec["prompt"])
        gen = rec["token_ids"]
        ref = log_softmax(rec["prompt_token_ids"] + gen)
        n = len(rec["prompt_token_ids"])
        assert [g["token_id"] for g in rec["generated"]] == gen
        for j, g in enumerate(rec["generated"]):
            # the context of a generated token: the generated tokens before it (not the prompt's), as vLLM
            check_position(g["candidates"], g["token_id"], 5, ref[n - 1 + j], tok, gen[max(0, j - 4):j], seen)
            # greedy: the sampled token is the most likely, so its logprob is the rank-1 entry's
            best = max(c[1] for c in g["candidates"])
            assert g["candidates"][0][2] == 1 and g["candidates"][0][1] == best
        chosen = [g["candidates"][0][1] for g in rec["generated"]]
        assert rec["cumulative_logprob"] == pytest.approx(math.fsum(chosen), abs=1e-9)
        assert rec["cumulative_logprob"] < 0
    assert seen == {"alone", "incomplete", "completed"}, seen  # the random model samples byte pieces: all 3 cases


def test_snippet_prompt_logprobs(snippet_run, reference) -> None:
    log_softmax, tok = reference
    seen: set[str] = set()
    for rec in snippet_run[:2]:
        prompt = rec["prompt_token_ids"]
        plp = rec["prompt_logprobs"]
        assert len(plp) == len(prompt) and plp[0] is None and all(p is not None for p in plp[1:])
        ref = log_softmax(prompt)
        for i in range(1, len(prompt)):
            assert plp[i]["token_id"] == prompt[i]
            # the context: the prompt tokens of the 4 positions before, the first (no logprobs) not among them
            check_position(plp[i]["candidates"], prompt[i], 2, ref[i - 1], tok, prompt[max(1, i - 4):i], seen)
    assert any(len(p["candidates"]) == 3 for rec in snippet_run[:2] for p in rec["prompt_logprobs"][1:]), \
        "no prompt token fell outside the top-2: the case where the chosen token adds an entry went unchecked"
    assert {"alone", "incomplete"} <= seen, seen


def test_snippet_chat_logprobs_zero(snippet_run, reference) -> None:
    _, tok = reference
    chat = snippet_run[2]
    ids = chat["chat_token_ids"]
    assert len(chat["chat_logprobs"]) == len(ids) > 0
    seen: set[str] = set()
    for j, (position, token_id) in enumerate(zip(chat["chat_logprobs"], ids, strict=True)):
        # logprobs=0: the sampled token alone; greedy, so rank 1
        assert [[c[0], c[2]] for c in position] == [[token_id, 1]]
        check_text(position[0][3], token_id, ids[max(0, j - 4):j], tok, seen)
    assert chat["chat_cumulative_logprob"] == pytest.approx(math.fsum(p[0][1] for p in chat["chat_logprobs"]))


def test_public_names() -> None:
    import keepwarm
    from keepwarm import LLM, SamplingParams  # noqa: F401 - the import is the test
    from keepwarm import Logprob as PublicLogprob

    assert PublicLogprob is Logprob and keepwarm.RequestOutput is RequestOutput
    assert keepwarm.CompletionOutput is CompletionOutput
    assert Logprob(-0.5) == Logprob(logprob=-0.5, rank=None, decoded_token=None)
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        _ = keepwarm.Nope


def test_vllm_position_outside_and_inside_the_top_k() -> None:
    def names(token_id: int, context: list[int]) -> str:
        assert context == [1, 2]  # every entry of a position is decoded in that position's context
        return {3: "c", 5: "e", 9: "i"}[token_id]

    outside = vllm_position(TokenLogprob(9, -4.0, 7, ((3, -0.5), (5, -1.0))), names, [1, 2])
    assert list(outside) == [9, 3, 5]  # chosen first, then the top-k in rank order
    assert outside == {9: Logprob(-4.0, 7, "i"), 3: Logprob(-0.5, 1, "c"), 5: Logprob(-1.0, 2, "e")}
    inside = vllm_position(TokenLogprob(5, -1.0, 2, ((3, -0.5), (5, -1.0))), names, [1, 2])
    assert list(inside) == [5, 3] and inside[5] == Logprob(-1.0, 2, "e")
    alone = vllm_position(TokenLogprob(3, -0.5, 1, ()), names, [1, 2])  # logprobs=0
    assert alone == {3: Logprob(-0.5, 1, "c")}


def test_to_vllm_output_keeps_the_rest() -> None:
    metrics = RequestMetrics(arrival_time=1.0, num_cached_tokens=16)
    engine_out = RequestOutput(
        "r1", "hi", [1, 3], [CompletionOutput(0, "x", [5], -1.0, [TokenLogprob(5, -1.0, 1, ((5, -1.0),))],
                                              "length", None),
                             CompletionOutput(1, "y", [3], None, None, "stop", 3)],
        finished=True, prompt_logprobs=[None, TokenLogprob(3, -2.0, 4, ())], metrics=metrics, error=None)
    out = to_vllm_output(engine_out, lambda t, ctx: f"<{t}:{ctx}>")
    assert (out.request_id, out.prompt, out.prompt_token_ids, out.finished) == ("r1", "hi", [1, 3], True)
    assert out.metrics is metrics and out.num_cached_tokens == 16
    assert out.prompt_logprobs == [None, {3: Logprob(-2.0, 4, "<3:[]>")}]
    a, b = out.outputs
    assert (a.index, a.text, a.token_ids, a.cumulative_logprob, a.finish_reason) == (0, "x", [5], -1.0, "length")
    assert a.logprobs == [{5: Logprob(-1.0, 1, "<5:[]>")}]
    assert b.logprobs is None and b.stop_reason == 3 and b.finished
    # the engine's output is left as the routes read it
    assert engine_out.outputs[0].logprobs == [TokenLogprob(5, -1.0, 1, ((5, -1.0),))]
    none = to_vllm_output(RequestOutput("r2", None, [1], [], finished=True, error="boom"), lambda t, ctx: None)
    assert none.prompt_logprobs is None and none.error == "boom"


def test_context_is_the_last_four_chosen_tokens() -> None:
    lps: list[TokenLogprob | None] = [None, *(TokenLogprob(t, -1.0, 1, ()) for t in (11, 12, 13, 14, 15, 16))]
    assert [context_of(lps, i) for i in range(len(lps))] == [
        [], [], [11], [11, 12], [11, 12, 13], [11, 12, 13, 14], [12, 13, 14, 15]]
    out = to_vllm_output(RequestOutput("r", None, [10, 11, 12, 13, 14, 15, 16], [], True, prompt_logprobs=lps),
                         lambda t, ctx: ",".join(map(str, ctx)))
    assert [None if p is None else p[t].decoded_token for p, t in zip(out.prompt_logprobs, [10, *range(11, 17)],
                                                                      strict=True)] == \
        [None, "", "11", "11,12", "11,12,13", "11,12,13,14", "12,13,14,15"]
    # a None inside the window (the first prompt position) shortens it, as in vLLM's
    assert context_of([TokenLogprob(7, -1.0, 1, ()), None, TokenLogprob(8, -1.0, 1, ())], 3) == [7, 8]


def metaspace_tokenizer():
    """A SentencePiece-style vocabulary (Metaspace pre-tokenizer and decoder): decode drops a lone token's ``▁``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({"<unk>": 0, "\u2581the": 1, "\u2581\u2581cat": 2, "s": 3}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Metaspace()])
    tok.decoder = decoders.Metaspace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")


def test_decoded_token_puts_back_sentencepiece_spaces(tiny_llama) -> None:
    sp = metaspace_tokenizer()
    assert space_marker(sp) == "\u2581"
    assert sp.decode([1]) == "the"  # what vLLM corrects
    decode = token_decoder(sp, lambda: "\u2581")
    assert [decode(1, []), decode(2, [1]), decode(3, [1, 2])] == [" the", "  cat", "s"]
    # byte-level BPE (the tiny model's) keeps its spaces: no marker, decode as is
    from keepwarm.worker.tokenizer import FastTokenizer

    bpe = FastTokenizer(tiny_llama)
    assert space_marker(bpe) is None and space_marker(object()) is None
    space = next(i for i in range(bpe.vocab_size) if bpe.decode([i]).startswith(" "))
    assert token_decoder(bpe, lambda: None)(space, []) == bpe.decode([space])
    assert token_decoder(None, lambda: "\u2581")(1, []) is None  # skip_tokenizer_init: no text


def test_decoded_token_completes_multibyte_characters(tiny_llama) -> None:
    from keepwarm.worker.tokenizer import FastTokenizer

    tok = FastTokenizer(tiny_llama)
    ids = tok.encode("a\U0001f600b", add_special_tokens=False)  # the emoji's 4 bytes take several byte tokens
    pieces = [tok.decode([i]) for i in ids]
    assert pieces[0] == "a" and pieces[-1] == "b" and len(ids) >= 4 and all(p == "\ufffd" for p in pieces[1:-1])
    decode = token_decoder(tok, lambda: None)
    texts = [decode(t, ids[max(0, i - 4):i]) for i, t in enumerate(ids)]
    # as vLLM: "" for each piece while the character is incomplete, the whole character on the one completing it
    assert texts == ["a", *[""] * (len(ids) - 3), "\U0001f600", "b"]
    assert decode(ids[1], []) == ""  # nothing before it to complete it with
    assert completed_text(tok, ids[2], [ids[1]]) == ("\U0001f600" if len(ids) == 4 else "")


def test_skip_tokenizer_init_gives_no_decoded_tokens(tiny_llama) -> None:
    from keepwarm import LLM, SamplingParams

    llm = LLM(model=tiny_llama, dtype="float32", max_model_len=64, skip_tokenizer_init=True)
    out = llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(temperature=0, max_tokens=2, logprobs=1,
                                                                     prompt_logprobs=0))[0]
    positions = [*out.outputs[0].logprobs, *out.prompt_logprobs[1:]]
    assert len(positions) == 4 and all(x.decoded_token is None for p in positions for x in p.values())
    assert [next(iter(p)) for p in out.prompt_logprobs[1:]] == [6, 7]
