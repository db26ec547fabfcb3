"""What the tests (and `bench/`) share: fakes of the fleet and the clouds' metadata, a real S3 server, a spot-like
cluster and its legs, a running fleet, a learner's and a replica's parts. Imported explicitly, by module."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]  # the repository: where configs/, the README, docs/ and cluster.yaml are
