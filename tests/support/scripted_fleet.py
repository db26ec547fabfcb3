"""A scripted fleet for episode runners (`app.rollout.episodes`): fixed turns in place of the model, and a toy
tokenizer under them, so that the tests of spotrl's environments and of OpenEnv's (tests/integration/test_openenv.py)
check trajectories token by token without vLLM."""

from contracts.rollouts import Choice

EOS = 0


def encode(text: str) -> list[int]:
    """A toy tokenizer: one id per character (ids >= 1000), so observations are easy to find in a sequence."""
    return [1000 + ord(c) for c in text]


def decode(ids: list[int]) -> str:
    return "".join(chr(i - 1000) for i in ids if i >= 1000)


class ScriptedFleet:
    """Answers turn k of every episode with `answers[k - 1]` (text, tokenised and closed by EOS), recording each
    prompt as a call (`requests` counts the requests: a batch of prompts is one)."""

    def __init__(self, answers, finish_reason="stop"):
        self.answers, self.finish_reason = answers, finish_reason
        self.calls: list[dict] = []
        self.requests = 0

    async def __call__(self, prompt_ids, model, n=1, max_tokens=16, temperature=1.0, top_p=1.0, top_k=-1, *, turn=None):
        self.requests += 1
        prompts = prompt_ids if prompt_ids and isinstance(prompt_ids[0], list) else [prompt_ids]
        out = []
        for prompt in prompts:
            self.calls.append({"prompt": list(prompt), "n": n, "max_tokens": max_tokens, "turn": turn})
            ids = (encode(self.answers[turn - 1]) + [EOS])[:max_tokens]
            finish = "length" if len(ids) == max_tokens and ids[-1] != EOS else self.finish_reason
            # Distinct log-probs per prompt and position, so a misplaced one is visible.
            out += [
                Choice(i, list(ids), [-(len(self.calls) + j / 10) for j in range(len(ids))], decode(ids), finish)
                for i in range(n)
            ]
        return out
