"""The tiny model: the embedded default's model and the demos', built on this machine with nothing downloaded.

It is no role of a run: it stands beside the products, above the run's roles (whose tasks, rewards and environments
it warms up on) and below the entry points, which build it before anything loads it.

- `tiny.build`: the build, its cache, and what the entry points call (`prepare_model`, `prepare_run`, `python -m tiny`).
- `tiny.folder`: the folder a config's model is built in, keyed by what its build depends on.
- `tiny.recipes`: the recipe of each task (`tiny.arithmetic`, `tiny.chains`, `tiny.reasoning_gym`, made as
  `tiny.recipe` says); `tiny.variants`: the warm-ups `model.tiny` switches on (a self teacher's context,
  `tiny.context`; tool episodes, `tiny.tools` and `tiny.tool_play`; chat-rendered prompts).
- `tiny.tokenizer`, `tiny.network`, `tiny.warmup`: its tokenizer, its network, and the warm-up every recipe runs.

It imports `app/`, `core/` and `contracts/`, never the fleet (`tests/unit/test_layers.py`); its chat templates are in
`core.chat_templates`, since the run recognises its tokenizer by them.
"""
