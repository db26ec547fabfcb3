"""The run's roles: what trains, above the base (`core/`) and the contracts, blind to the fleet's insides.

- `app.learner`: the LoRA learner, one rank per device as Ray actors (FSDP2), its notices, checkpoints, scoring; and
  the Tinker API's learner (`app.learner.tinker_learner`: one adapter per Tinker training client).
- `app.rollout`: the rollout actor that keeps generations in flight on the fleet, samples (completions or
  multi-turn episodes), partial rollouts, the teacher's scoring, the judges that reward (`app.rollout.judges`),
  staleness rules.
- `app.objectives`: what the learner optimises (GRPO, distillation), as annotations and losses over token streams.
- `app.tasks`: problems, rewards, environments (spotrl's, OpenEnv's through its own client, and TRL's
  `environment_factory` contract), and the names a config gives them.
- the modules at its root: the fleet's HTTP client (`fleet_client`), joining a shared fleet (`fleet_run`), weight
  sync (`weight_sync`), the teacher at start (`teacher_setup`), evaluation, the run's log and metrics, the drift
  alarm (`diagnosis`), the sizing plan (`plan`), the driver's spot notices (`spot`). The tiny model is no role of a run: it is `tiny/`, beside the products.

It talks to the fleet over HTTP (or a Serve handle by name) only; the driver that wires it to a fleet is
`launch.train`.
"""
