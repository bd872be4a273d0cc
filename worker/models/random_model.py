"""Tiny (or large) random Llama-family models and an offline-trained tokenizer, for tests and benchmarks.

No model hub is reachable, so tests build their models with transformers and train a small byte-level BPE
tokenizer with `tokenizers`. ``initializer_range`` is larger than transformers' 0.02 default so that the
logits of a random model are peaked: greedy decoding then has clear winners, and comparing engines
token-for-token tests the engine rather than float rounding of near-ties.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_CORPUS = [
    "The quick brown fox jumps over the lazy dog while the cat sleeps in the warm sun.",
    "Serving large language models means keeping weights warm in memory and batching requests.",
    "A paged key value cache splits attention memory into fixed size blocks that sequences share.",
    "Prefix caching reuses blocks when two prompts start with the same tokens, saving compute.",
    "Héllo wörld, naïve café, 你好世界, こんにちは, 🙂 emoji and other multi byte characters.",
    "Numbers like 12345 and 3.14159 appear in text, as do symbols: #, $, %, &, *, (, ), [, ].",
    "Once upon a time there was a small model that answered questions about the capital of France.",
    "def main():\n    print('hello world')\n    return 0\n",
]


def make_tokenizer(out_dir: str | Path, vocab_size: int = 512) -> None:
    """Train a byte-level BPE tokenizer offline and save it as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_CORPUS * 20, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                   eos_token="<|im_end|>", pad_token="</s>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out_dir))


def make_random_model(out_dir: str | Path, arch: str = "llama", *, seed: int = 0, vocab_size: int = 512,
                      hidden_size: int = 128, intermediate_size: int = 256, num_hidden_layers: int = 2,
                      num_attention_heads: int = 4, num_key_value_heads: int = 2, head_dim: int | None = None,
                      tie_word_embeddings: bool = False, max_position_embeddings: int = 1024,
                      initializer_range: float = 0.2, dtype: str = "float32", tokenizer: bool = True,
                      max_shard_size: str | None = None, **extra: Any) -> Path:
    """Save a random ``llama`` / ``mistral`` / ``qwen2`` model (safetensors) plus tokenizer to ``out_dir``."""
    import torch
    import transformers

    classes = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    }
    config_cls, model_cls = classes[arch]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if tokenizer:
        make_tokenizer(out, vocab_size=vocab_size)
        tok_json = json.loads((out / "tokenizer.json").read_text())
        ids = {t["content"]: t["id"] for t in tok_json["added_tokens"]}
        bos, eos = ids["<s>"], ids["<|im_end|>"]
    else:
        bos, eos = 1, 2
    kwargs = dict(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
                  num_hidden_layers=num_hidden_layers, num_attention_heads=num_attention_heads,
                  num_key_value_heads=num_key_value_heads, tie_word_embeddings=tie_word_embeddings,
                  max_position_embeddings=max_position_embeddings, initializer_range=initializer_range,
                  bos_token_id=bos, eos_token_id=eos, pad_token_id=eos, **extra)
    if head_dim is not None:
        kwargs["head_dim"] = head_dim
    config = config_cls(**kwargs)
    torch.manual_seed(seed)
    with torch.device("cpu"):
        model = model_cls(config).to(getattr(torch, dtype))
    save_kwargs: dict[str, Any] = {"safe_serialization": True}
    if max_shard_size:
        save_kwargs["max_shard_size"] = max_shard_size
    model.save_pretrained(out, **save_kwargs)
    return out
