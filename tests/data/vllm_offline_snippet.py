"""Offline inference written for vLLM's documented API (``vllm.LLM``, ``vllm.SamplingParams``, the fields of
``vllm.outputs.RequestOutput`` / ``CompletionOutput`` and ``vllm.logprobs.Logprob``), the way vLLM's
examples/offline_inference use it. Nothing here knows about keepwarm: tests/unit/worker/test_offline_api.py runs this
file with its one import line changed to ``from keepwarm import LLM, SamplingParams`` and checks what it prints.

Usage: python vllm_offline_snippet.py MODEL_DIR  (prints the example's lines, then one JSON line)
"""

import json
import sys

from vllm import LLM, SamplingParams


def main(model: str) -> None:
    prompts = [
        "Hello, my name is",
        "The capital of France is",
    ]

    llm = LLM(model=model, dtype="float32", max_model_len=256, enforce_eager=True, seed=0)

    # The basic example: sample, print each prompt with its continuation.
    for output in llm.generate(prompts, SamplingParams(temperature=0.8, top_p=0.95, max_tokens=8)):
        print(f"Prompt: {output.prompt!r}, Generated text: {output.outputs[0].text!r}")

    # Greedy, with the top-5 logprobs of every generated token and the top-2 of every prompt token.
    params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=5, prompt_logprobs=2)
    outputs = llm.generate(prompts, params, use_tqdm=False)

    records = []
    for output in outputs:
        completion = output.outputs[0]
        generated = []
        for token_id, position in zip(completion.token_ids, completion.logprobs, strict=True):
            generated.append({
                "token_id": token_id,
                "candidates": [[tid, lp.logprob, lp.rank, lp.decoded_token] for tid, lp in position.items()],
            })
        prompt_positions = []
        for token_id, position in zip(output.prompt_token_ids, output.prompt_logprobs, strict=True):
            if position is None:  # the first prompt token: nothing comes before it
                prompt_positions.append(None)
                continue
            prompt_positions.append({
                "token_id": token_id,
                "candidates": [[tid, lp.logprob, lp.rank, lp.decoded_token] for tid, lp in position.items()],
            })
        records.append({
            "request_id": output.request_id,
            "prompt": output.prompt,
            "prompt_token_ids": list(output.prompt_token_ids),
            "finished": output.finished,
            "num_cached_tokens": output.num_cached_tokens,
            "index": completion.index,
            "text": completion.text,
            "token_ids": list(completion.token_ids),
            "cumulative_logprob": completion.cumulative_logprob,
            "finish_reason": completion.finish_reason,
            "stop_reason": completion.stop_reason,
            "generated": generated,
            "prompt_logprobs": prompt_positions,
        })

    # A chat turn, with the sampled token's logprob alone (logprobs=0).
    conversation = [{"role": "user", "content": "Write one word."}]
    chat = llm.chat(conversation, sampling_params=SamplingParams(temperature=0.0, max_tokens=4, logprobs=0),
                     use_tqdm=False)
    chat_completion = chat[0].outputs[0]
    records.append({
        "chat_token_ids": list(chat_completion.token_ids),
        "chat_logprobs": [[[tid, lp.logprob, lp.rank, lp.decoded_token] for tid, lp in position.items()]
                          for position in chat_completion.logprobs],
        "chat_cumulative_logprob": chat_completion.cumulative_logprob,
    })
    print(json.dumps(records))


if __name__ == "__main__":  # vLLM starts its engine in a spawned process: the idiom is needed there
    main(sys.argv[1])
