"""TRL environments (`environment_factory`) that fail as other people's do, and a reward written as TRL users write
them, for the driver's tests (tests/integration/test_train.py): a failing `reset` costs its episodes, held-out ones
included, and one that always fails stops the run with one line."""


class ResetRaisesSometimes:
    """No tools; `reset` raises on the problems whose answer is a multiple of 4 (about one in four), as a sandbox
    that cannot start for some of them."""

    def reset(self, answer: str, **row) -> None:
        if int(answer) % 4 == 0:
            raise RuntimeError(f"no sandbox for {answer}")


class ResetAlwaysRaises:
    """No tools; `reset` raises on every problem, as a sandbox service that is down."""

    def reset(self, answer: str, **row) -> None:
        raise RuntimeError("the sandbox service is down")


def counted_right(completions, answer, environments=None, **kwargs):
    """A reward as TRL's docs write them: keyword parameters in their own order, `environments` defaulted; the
    completions are messages, the last one the model's answer."""
    return [float(c[-1]["content"].strip() == a) for c, a in zip(completions, answer, strict=True)]
