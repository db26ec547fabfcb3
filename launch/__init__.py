"""The entry points: the only modules that import both the run's roles (`app/`) and the fleet (`deployments/`).

- `launch.train`: the driver (`make train`, `python -m launch.train`): starts or joins Ray, brings a fleet up or
  joins a shared one, starts the learner, the teacher and the rollout, runs the loop, evaluates.
- `launch.serve`: `build_app`, what `serve run serve_config.yaml` (`make serve`) imports: a fleet on its own.
- `launch.tinker`: the Tinker API beside a running fleet (its learner actor and its Serve application).
- `launch.evaluate`: held-out accuracy of a committed version or an adapter folder, on a fleet started as the driver
  starts one (or a running one).
- `launch.runs`: list, inspect and remove the runs of a shared fleet, through its admin API.
- `launch.cli`: the `spotrl` command, whose subcommands run these modules' `main(argv)` (and `app.plan`'s);
  `launch.config_help` lists a config's fields for its `--help`.

Each builds the tiny model first where it is the one served (`tiny.build.prepare_model`).
"""
