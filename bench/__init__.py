"""Benchmarks: `python -m bench.<name>`, or `make bench` for all; results under bench/results/.

Benchmarks talk to 127.0.0.1 only: the clouds' metadata endpoints, which spot-notice watchers ask
(`contracts.notices`), are a closed loopback port here unless the environment says otherwise.
"""

import os

os.environ.setdefault("AWS_EC2_METADATA_SERVICE_ENDPOINT", "http://127.0.0.1:9")
os.environ.setdefault("GCE_METADATA_HOST", "127.0.0.1:9")
