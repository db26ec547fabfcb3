"""What crosses the Serve handle for a generation, as types: the request, its answer, its failures.

A generation crosses three hands: the ingress validates the HTTP body and builds one
`GenerateRequest`; the PrefixHashRouter, inside the ingress's handle, reads its `prompt_ids` and
`model` to pick a replica; the replica turns its `sampling` into vLLM's `SamplingParams`. One type
for the three, built once, so a field added here reaches every hop and a renamed one fails loudly
instead of being dropped on the way. Replies come back as `Generated`, failures as `ReplicaError`s
that carry the HTTP status the ingress answers with.

Nothing here imports Ray, vLLM or FastAPI: the ingress, the replicas, the clients and the unit tests import it
cheaply, and Ray pickles these classes by reference on both sides of the handle. The fleet's control calls
(load, unload, pause, ...) are typed the same way in `contracts.control`.
"""

from __future__ import annotations

from dataclasses import dataclass

# The fleet as callers inside its Ray cluster name it: `serve://<application>` (a Serve handle to the ingress).
SERVE_SCHEME = "serve://"


def serve_address(app_name: str) -> str:
    """The fleet's address for callers inside its Ray cluster, on any node: its Serve application's name."""
    return f"{SERVE_SCHEME}{app_name}"


# The fleet's Serve deployments by name: what the builder names them, and what a replica asks Serve for (its ingress).
REPLICA_DEPLOYMENT = "VLLMReplica"
INGRESS_DEPLOYMENT = "Ingress"
TEACHER_DEPLOYMENT = "TeacherReplica"

# The VLLMReplica method that samples (called with one GenerateRequest); the router routes its calls by prefix.
GENERATE_METHOD = "generate"
# The VLLMReplica method that samples several requests in one call (called with one GenerateBundle), routed alike.
BUNDLE_METHOD = "generate_bundle"

# How /pause treats in-flight requests (vLLM's modes). `keep` freezes them until /resume: nothing is lost.
PAUSE_MODES = ("keep", "wait", "abort")


@dataclass(frozen=True)
class Sampling:
    """How to sample: exactly vLLM's `SamplingParams` fields, under vLLM's names, with vLLM's defaults."""

    n: int = 1
    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k (the ingress maps OpenAI's -1 to it)
    min_p: float = 0.0
    seed: int | None = None
    logprobs: int | None = None  # None: no log-probs; k: the sampled token's and the top k alternatives
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop: list[str] | None = None  # stop strings: the engine detokenizes the requests that carry them (and only those)
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    prompt_logprobs: int | None = None  # None: none; k: each prompt token's log-prob and the top k alternatives


# Positions every engine holds past the context the fleet serves (`model.max_model_len`): a scoring request of a
# sample that fills the context (`prompt_logprobs`, max_tokens 1) samples its one token there, which nothing ever
# feeds back through the model. Generations never reach it: the ingress bounds them by the context.
SCORING_ROOM = 1

# What a -inf log-prob (a token the model rules out) is on the wire, as vLLM's server answers it: JSON has no
# infinity. A client reads it back as -inf (`app.fleet_client`): it is no log-prob of 9999 nats.
LOGPROB_FLOOR = -9999.0

# A scoring answer, per prompt position: None at the first (nothing before it to condition on), else
# {token id: (log-prob, rank in the vocabulary)} for the prompt's own token and the top alternatives asked for.
PromptLogprobs = list[dict[int, tuple[float, int | None]] | None]


@dataclass(frozen=True)
class GenerateRequest:
    """One prompt to sample `sampling.n` completions of, under `model`.

    The router's contract: it hashes `prompt_ids` (never text: the engine caches token blocks) in
    the namespace `model`, the base model's canonical name or an adapter's, and counts its decision
    under `turn` too when the client said which turn of an episode the request is. A request of a `session` (a
    client's `X-Session-ID`: one rollout's turns) goes where the session's earlier requests went.
    """

    prompt_ids: list[int]
    model: str
    sampling: Sampling
    turn: int | None = None  # a multi-turn episode's turn (1-based) that this request continues, for per-turn stats
    session: str | None = None  # the client's session (verifiers' X-Session-ID), kept on one replica by the router


@dataclass(frozen=True)
class GenerateBundle:
    """Requests of one run that share their routing (model, session, first KV block) sent in one replica call.

    A client that sends one request per sequence (one sample, one scored sequence) would otherwise pay a Serve handle
    call and a replica call each; the engine batches them anyway. The router routes the bundle as its first request
    (the others would route alike) and records every request's blocks; the replica samples each as a request of its
    own and answers each apart (`deployments.replica.shell.Replica.generate_bundle`)."""

    requests: tuple[GenerateRequest, ...]


@dataclass
class SampledChoice:
    """One completion as the engine produced it: token ids and their log-probs, never text. A completion that a stop
    string ended carries that string as its `stop_reason`, and its tokens up to the one that completed it."""

    index: int
    token_ids: list[int]
    logprobs: list[float] | None  # the sampled tokens' (processed, at the sampling temperature)
    top_logprobs: list[dict[int, float]] | None  # per position, the top alternatives, when asked for
    finish_reason: str | None
    stop_reason: int | str | None
    prompt_logprobs: PromptLogprobs | None = None  # the prompt's, when asked for (the same for every choice)


# The finish reason of a choice cut short by its replica (vLLM's own for an aborted request): its tokens so far.
ABORTED = "abort"


@dataclass
class Generated:
    """A replica's answer to a GenerateRequest: who served it (for `x-spotrl-replica`) and the choices.

    `handed_back`: the replica cut the generation short and handed it back (its node is going, `contracts.control.
    HandBack`): the choices whose `finish_reason` is `ABORTED` hold the tokens generated so far, to be continued
    elsewhere from prompt + those tokens (`deployments.ingress.handback`)."""

    replica: str
    choices: list[SampledChoice]
    handed_back: bool = False


class ReplicaError(Exception):
    """A call failed in a replica, with the HTTP status the ingress answers it with (500 unless said)."""

    status = 500

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.message = message
        if status is not None:
            self.status = status

    def __reduce__(self):  # keep the status through Ray's pickling
        return (type(self), (self.message, self.status))


class BadRequest(ReplicaError):
    status = 400


class ModelNotFound(ReplicaError):
    status = 404


class ReplicaUnavailable(ReplicaError):
    """This replica cannot serve (engine dead, shutting down): the ingress retries on another one."""

    status = 503


class ReplicaDraining(ReplicaUnavailable):
    """This replica's node is going (a spot notice): it takes no new request, the ingress sends it elsewhere and its
    router routes nothing more to `replica` (the Serve replica id)."""

    def __init__(self, message: str, replica: str = "", status: int | None = None):
        super().__init__(message, status)
        self.replica = replica

    def __reduce__(self):
        return (type(self), (self.message, self.replica, self.status))


class EngineDied(ReplicaError):
    """The replica's engine died while it served this request, which may be what killed it.

    Not a `ReplicaUnavailable`: the ingress sends such a request to one more replica only
    (`deployments.ingress.poison`), so that a request that crashes engines cannot go round the fleet.
    """

    status = 503
