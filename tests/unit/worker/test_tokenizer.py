"""keepwarm's light tokenizer (tokenizers + jinja2) behaves like transformers' AutoTokenizer."""

from __future__ import annotations

import pytest

from keepwarm.worker.tokenizer import FastTokenizer, TokenizerError

TEXTS = ["Hello world", " leading space", "Héllo wörld 你好 🙂", "<|im_start|>user\nhi<|im_end|>",
         "The capital of France is", ""]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4"}, {"role": "user", "content": "And 3+3?"}]


@pytest.fixture(params=["tiny", "smollm2"])
def model_dir(request, tiny_llama) -> str:
    if request.param == "tiny":
        return tiny_llama
    from keepwarm.worker.default_model import default_model

    return str(default_model())


def test_matches_transformers(model_dir) -> None:
    from transformers import AutoTokenizer

    ref, ours = AutoTokenizer.from_pretrained(model_dir), FastTokenizer(model_dir)
    for text in TEXTS:
        for special in (True, False):
            assert ours.encode(text, add_special_tokens=special) == ref.encode(text, add_special_tokens=special)
        ids = ref.encode(text)
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip)
    for gen in (True, False):
        assert ours.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=gen) == \
            ref.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=gen)
    assert ours.apply_chat_template(CHAT[:3], tokenize=False, continue_final_message=True) == \
        ref.apply_chat_template(CHAT[:3], tokenize=False, continue_final_message=True)
    assert (ours.eos_token_id, ours.bos_token_id) == (ref.eos_token_id, ref.bos_token_id)


def test_template_errors_are_clear(tiny_llama) -> None:
    tok = FastTokenizer(tiny_llama)
    with pytest.raises(TokenizerError, match="boom"):
        tok.apply_chat_template(CHAT, chat_template="{{ raise_exception('boom') }}", tokenize=False)


def test_a_preloaded_tokenizer_is_reused_until_its_files_change(tiny_llama, tmp_path) -> None:
    """What a zygote preloads (worker/zygote.prepare) is what load_tokenizer returns in its forks, with its chat
    template compiled and its longest token counted; a changed tokenizer file, or another directory, loads afresh."""
    import os
    import shutil

    from keepwarm.worker import tokenizer as tk

    d = tmp_path / "tok"
    d.mkdir()
    for name in tk._TOKENIZER_FILES:
        if (src := os.path.join(tiny_llama, name)) and os.path.exists(src):
            shutil.copy(src, d / name)
    try:
        assert tk.preload_tokenizer(d)
        kept = tk.load_tokenizer(d)
        assert kept is tk.load_tokenizer(d) and len(kept._compiled) == int(kept.chat_template is not None)
        assert "longest_token_chars" in vars(kept)  # computed at preload
        assert tk.load_tokenizer(tiny_llama) is not kept  # another directory
        st = (d / "tokenizer_config.json").stat()
        os.utime(d / "tokenizer_config.json", ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
        fresh = tk.load_tokenizer(d)
        assert fresh is not kept and fresh.encode("Hello world") == kept.encode("Hello world")
        assert not tk.preload_tokenizer(tmp_path)  # no tokenizer.json: nothing kept
    finally:
        tk._PRELOADED.clear()
