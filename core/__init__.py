"""The base: what a run and a fleet both stand on, above the contracts and below both products.

- `core.config`: a run's and a fleet's config (pydantic, YAML, `--set` overrides), every mistake one line naming
  the field.
- `core.bucket`: the bucket, the only thing the learner and the fleet share: committed folders with checksummed
  (and, for adapters, signed) manifests, their verified local cache, the fleet's run records.
- `core.models`: where the model and its tokenizer come from (the tiny model is named by the folder the entry points
  build: `tiny.build.prepare_model`), its fingerprint, tokenizer checks; `core.chat_templates`: the tiny model's chat
  templates, by which the run recognises its tokenizer.
- `core.local_ray`: the one place that decides what a Ray of ours listens on (loopback only).

It imports `contracts/` alone (`tests/unit/test_layers.py`).
"""
