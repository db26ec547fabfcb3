#!/usr/bin/env bash
# `make serve`: run the fleet from a Serve config on a local Ray head bound to loopback.
# Starts the head only if none answers at $RAY_ADDRESS (default 127.0.0.1:6379); leaves it running
# afterwards (stop it with `.venv/bin/ray stop`). Ctrl-C stops `serve run` and the fleet's application.
# Every port of the head is on 127.0.0.1; RAY_DASHBOARD_PORT (8265), RAY_METRICS_EXPORT_PORT (8080) and
# RAY_CLIENT_SERVER_PORT (10001) move the fixed ones.
#   bash ops/serve_local.sh [serve_config.yaml]
set -euo pipefail
cd "$(dirname "$0")/.."
CONFIG="${1:-serve_config.yaml}"
BIN="$(pwd)/.venv/bin"
export RAY_ADDRESS="${RAY_ADDRESS:-127.0.0.1:6379}"
# Every Ray process (the controller that builds the app, the router inside the ingress) imports
# deployments.* and app.*: put the repository on their path even when the project is not installed.
export PYTHONPATH="$(pwd)${PYTHONPATH:+:$PYTHONPATH}"
export RAY_USAGE_STATS_ENABLED=0 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
# The head listens on 127.0.0.1 only, every process of it (as `make train`'s Ray: core/local_ray.py).
# `ray start --node-ip-address 127.0.0.1` swaps loopback for the machine's external address; with this
# (Ray's single-machine mode) the node address stays 127.0.0.1 for the head and every process it starts,
# and the GCS, raylet, workers, agents and metrics ports bind it.
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0
# Every worker imports core.local_ray first, which keeps Serve's per-replica gRPC server (`[::]:0` in Ray) on loopback.
LOOPBACK_SYSTEM_CONFIG='{"preload_python_modules": ["core.local_ray"]}'
# Token auth on for the head and, explicitly, for `serve run` too (which otherwise connects without the token).
export RAY_AUTH_MODE="${RAY_AUTH_MODE:-token}"

head_answers() {
  # A quick TCP probe first: on a port where nothing listens, `ray status` takes ~40 s to give up.
  (exec 3<>"/dev/tcp/${RAY_ADDRESS%:*}/${RAY_ADDRESS##*:}") 2>/dev/null || return 1
  "$BIN/ray" status --address "$RAY_ADDRESS" >/dev/null 2>&1
}

if ! head_answers; then
  echo "serve_local: starting a Ray head on $RAY_ADDRESS (metrics on 127.0.0.1:${RAY_METRICS_EXPORT_PORT:-8080})"
  # `ray start` refuses token auth without a token; `ray.init` would make one (~/.ray/auth_token), so do we.
  if [ "${RAY_AUTH_MODE}" = token ]; then "$BIN/ray" get-auth-token --generate >/dev/null; fi
  "$BIN/ray" start --head --node-ip-address 127.0.0.1 --port "${RAY_ADDRESS##*:}" \
    --dashboard-host 127.0.0.1 --dashboard-port "${RAY_DASHBOARD_PORT:-8265}" \
    --metrics-export-port "${RAY_METRICS_EXPORT_PORT:-8080}" \
    --ray-client-server-port "${RAY_CLIENT_SERVER_PORT:-10001}" \
    --system-config "$LOOPBACK_SYSTEM_CONFIG" --disable-usage-stats >/dev/null
fi
exec "$BIN/serve" run "$CONFIG"
