"""The kinds of environment a run plays, one module each, and the registry that picks the run's
(`app.kinds.registry`): what each does at run time (its sampler, its check at start, where its problems come from);
its config is a field of `core.config.envs.EnvConfig`."""
