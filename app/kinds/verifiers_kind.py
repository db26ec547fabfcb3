"""A verifiers v1 taskset (`env.verifiers`): its tasks are the run's problems, played by verifiers' own env with its
training client pointed at the fleet (`app.rollout.verifiers_episodes`), scored by its `@vf.reward`s.
verifiers is imported only by runs that name it."""

from __future__ import annotations

from app.kinds.kind import EnvKind


class VerifiersTasksets(EnvKind):
    field = "verifiers"
    unjudged = (
        "verifiers plays and scores its episodes itself (the taskset's @vf.reward), where spotrl's judges never see "
        "them; judge in the taskset instead"
    )

    def problems(self, cfg):
        """The taskset's tasks in its order: the first `task.num_heldout` held out, the next `task.num_train`."""
        from app.tasks.verifiers_tasksets import load_env, task_splits, taskset_tasks

        tasks = taskset_tasks(load_env(cfg.env.verifiers))
        return task_splits(tasks, cfg.task.num_heldout, cfg.task.num_train)

    def check(self, cfg) -> None:
        from app.tasks.verifiers_tasksets import check_verifiers

        check_verifiers(cfg)

    def sampler(self, cfg, tokenizer, generate, decode, fleet):
        from app.rollout.verifiers_episodes import VerifiersRunner

        return VerifiersRunner.from_config(
            cfg, tokenizer, generate, decode, fleet_url=fleet.url, token=fleet.token, model_path=fleet.model_path
        )
