"""A stand-in for a Serve handle to the replicas, for the ingress's backend (`deployments.ingress.shell.ServeBackend`):
it answers each generation call (one request, or a bundle) with the next of the outcomes it is given."""

from __future__ import annotations

from contracts.serving import BUNDLE_METHOD, GENERATE_METHOD


class GenerateHandle:
    """Answers generation calls with the given outcomes in turn (an exception is raised, anything else returned)."""

    def __init__(self, *outcomes):
        self.outcomes, self.sent = list(outcomes), []

    def options(self, method_name):
        assert method_name in (GENERATE_METHOD, BUNDLE_METHOD)
        return self

    def remote(self, request):
        self.sent.append(request)
        outcome = self.outcomes.pop(0)

        async def reply():
            if isinstance(outcome, BaseException):
                raise outcome
            return outcome

        return reply()
