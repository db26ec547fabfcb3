"""The fleet's HTTP API: OpenAI-compatible inference, vLLM's admin calls and a shared fleet's runs, by job.

It speaks what TRL's AsyncGRPOTrainer and the `openai` client send: `/v1/completions`,
`/v1/chat/completions`, `/v1/models`, `/health`, `/server_info`, and the admin calls
`/v1/load_lora_adapter`, `/v1/unload_lora_adapter`, `/pause`, `/resume`, `/reset_prefix_cache`, each
applied to every replica. Each module has one job, over the control layer (`deployments.control`):

- `server`: `make_app`, which puts the routes together over a `Backend`, and the error replies.
- `settings`: `ApiSettings`, what the ingress knows about its model and its fleet.
- `callers`: who sent a request (admin, run, anonymous) and what they may do; admin calls declare JSON.
- `intake`, `bodies`: a request's body, bounded, parsed and validated; `prompts`: its prompts, tokenized.
- `replies`: OpenAI's response shapes, always valid JSON.
- `inference_routes`, `status_routes`, `admin_routes`, `run_routes`: the handlers, by job (`routing`).
"""

from deployments.api.server import make_app
from deployments.api.settings import ApiSettings

__all__ = ["ApiSettings", "make_app"]
