"""A call that fails a given number of times, then answers: what the retry policy's and the bucket's tests retry."""

from __future__ import annotations


class Flaky:
    """Fails with `error` the first `failures` calls, then returns "ok"."""

    def __init__(self, failures: int, error: BaseException):
        self.failures, self.error, self.calls = failures, error, 0

    def __call__(self):
        self.calls += 1
        if self.calls <= self.failures:
            raise self.error
        return "ok"
