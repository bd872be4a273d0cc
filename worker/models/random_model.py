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

import torch
import transformers
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Qwen 2.5's shape of tool support (Hermes format): tools listed in the system turn, calls in <tool_call> tags,
# results in <tool_response> tags inside a user turn.
TOOLS_CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}\n\n"
    "{% endif %}# Tools\n\nYou may call one or more functions.\n<tools>\n{% for tool in tools %}"
    "{{ tool | tojson }}\n{% endfor %}</tools>\n\nFor each call return <tool_call>{\"name\": <name>, "
    "\"arguments\": <args-json-object>}</tool_call><|im_end|>\n"
    "{% elif messages[0]['role'] == 'system' %}<|im_start|>system\n{{ messages[0]['content'] }}<|im_end|>\n"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}"
    "{% elif message['role'] == 'assistant' and message.tool_calls %}<|im_start|>assistant\n"
    "{% if message['content'] %}{{ message['content'] }}{% endif %}"
    "{% for call in message.tool_calls %}\n<tool_call>\n{\"name\": \"{{ call.function.name }}\", "
    "\"arguments\": {{ call.function.arguments | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n"
    "{% elif message['role'] == 'tool' %}<|im_start|>user\n<tool_response>\n{{ message['content'] }}\n"
    "</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endif %}"
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


def make_tokenizer(out_dir: str | Path, vocab_size: int = 512, chat_template: str = CHAT_TEMPLATE) -> None:
    """Train a byte-level BPE tokenizer offline and save it as a transformers fast tokenizer."""
    specials = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_CORPUS * 20, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                   eos_token="<|im_end|>", pad_token="</s>")
    fast.chat_template = chat_template
    fast.save_pretrained(str(out_dir))


def make_random_model(out_dir: str | Path, arch: str = "llama", *, seed: int = 0, vocab_size: int = 512,
                      hidden_size: int = 128, intermediate_size: int = 256, num_hidden_layers: int = 2,
                      num_attention_heads: int = 4, num_key_value_heads: int = 2, head_dim: int | None = None,
                      tie_word_embeddings: bool = False, max_position_embeddings: int = 1024,
                      initializer_range: float = 0.2, dtype: str = "float32", tokenizer: bool = True,
                      max_shard_size: str | None = None, chat_template: str = CHAT_TEMPLATE,
                      **extra: Any) -> Path:
    """Save a random model of one of transformers' classes below (safetensors) plus tokenizer to ``out_dir``;
    ``extra`` goes to the config class (windows, experts, soft-capping, rope parameters, ...)."""
    classes = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "gemma2": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM),
        "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM),
        "phi3": (transformers.Phi3Config, transformers.Phi3ForCausalLM),
        "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM),
        "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
    }
    config_cls, model_cls = classes[arch]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if tokenizer:
        make_tokenizer(out, vocab_size=vocab_size, chat_template=chat_template)
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


LARGE_PRESETS: dict[str, dict[str, int]] = {
    # ~1.0B parameters (Llama-3.2-1B-like shapes with a 32k vocabulary, untied).
    "1b": dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=20,
               num_attention_heads=32, num_key_value_heads=8),
    # ~8B parameters (Llama-3-8B shapes).
    "8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
               num_attention_heads=32, num_key_value_heads=8),
}


def make_large_random_model(out_dir: str | Path, preset: str = "1b", dtype: str = "bfloat16", seed: int = 0,
                            shard_bytes: int = 2 << 30, device: str = "cpu") -> Path:
    """A large random Llama written tensor by tensor (no transformers model in memory), sharded with an index.

    Weights are N(0, 0.02) like transformers' init; the point is size and shapes, not text quality. ``device``
    draws them there ("cuda": an 8B model's 16 GB in seconds rather than minutes of CPU randn); the values depend
    on the device's generator, not only on ``seed``."""
    out = Path(out_dir)
    if (out / "config.json").is_file():
        return out
    out.mkdir(parents=True, exist_ok=True)
    c = LARGE_PRESETS[preset]
    h, i, L = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"]
    hd = h // c["num_attention_heads"]
    kv = c["num_key_value_heads"] * hd
    shapes: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (c["vocab_size"], h))]
    for n in range(L):
        p = f"model.layers.{n}."
        shapes += [(p + "input_layernorm.weight", (h,)), (p + "post_attention_layernorm.weight", (h,)),
                   (p + "self_attn.q_proj.weight", (h, h)), (p + "self_attn.k_proj.weight", (kv, h)),
                   (p + "self_attn.v_proj.weight", (kv, h)), (p + "self_attn.o_proj.weight", (h, h)),
                   (p + "mlp.gate_proj.weight", (i, h)), (p + "mlp.up_proj.weight", (i, h)),
                   (p + "mlp.down_proj.weight", (h, i))]
    shapes += [("model.norm.weight", (h,)), ("lm_head.weight", (c["vocab_size"], h))]
    tdtype = getattr(torch, dtype)
    gen = torch.Generator(device=device).manual_seed(seed)
    weight_map: dict[str, str] = {}
    shard: dict[str, torch.Tensor] = {}
    size, index = 0, 0

    def flush() -> None:
        nonlocal shard, size, index
        if shard:
            index += 1
            name = f"model-{index:05d}.safetensors"
            save_file(shard, str(out / name), metadata={"format": "pt"})
            weight_map.update({k: name for k in shard})
            shard, size = {}, 0

    for name, shape in shapes:
        t = torch.ones(shape, dtype=tdtype) if len(shape) == 1 else \
            (torch.randn(shape, generator=gen, device=device) * 0.02).to(tdtype).cpu()
        if size + t.numel() * t.element_size() > shard_bytes:
            flush()
        shard[name] = t
        size += t.numel() * t.element_size()
    flush()
    total = sum(torch.Size(s).numel() for _, s in shapes) * torch.empty((), dtype=tdtype).element_size()
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
              "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
              "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}, "dtype": dtype,
              "bos_token_id": 1, "eos_token_id": 2, "head_dim": hd, **c}
    make_tokenizer(out)
    (out / "config.json").write_text(json.dumps(config, indent=1))  # last: marks the directory complete
    return out
