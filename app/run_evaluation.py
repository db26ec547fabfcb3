"""The run's evaluations through the fleet (`app.evaluate`): the baseline before the first step, the versions
evaluated during training (`app.periodic_eval`) with the extra sets (`eval.extra`), the best version kept
(`eval.keep_best`), and the trained policy after the last step. The driver (`launch.train`) holds one.
"""

from __future__ import annotations

import json
import logging
import shutil
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from app.messages import ResumePoint
from app.periodic_eval import EvalPoint, Measured, eval_summary
from app.spot import resumed_line
from contracts.adapters import adapter_name
from core.config import RunConfig

log = logging.getLogger("spotrl.train")


def lost_note(heldout: dict) -> str:
    """What the log line of an evaluation adds when the environment lost some of its episodes (scored unsolved), and
    how often each judge of a judged run agreed with the measure."""
    lost = heldout.get("lost", 0)
    note = f"; {lost} of {heldout['num_problems']} episodes lost, scored unsolved" if lost else ""
    agreed = heldout.get("judge_agreement") or {}
    return note + "".join(f"; judge {name} agrees with it on {share:.1%}" for name, share in agreed.items())


class Evaluation:
    """Held-out accuracy through the fleet (`app.evaluate`), and the run's baseline: measured once, before the first
    step, and kept in the run's folder, so that a resumed run reports the accuracy it started from. During training
    (`app.periodic_eval`) it measures the extra sets too (`eval.extra`, each a config with its own task and
    environment), and keeps the best version (`eval.keep_best`)."""

    def __init__(
        self,
        cfg: RunConfig,
        base_url: str,
        model_path: str,
        token: str | None,
        extra_sets: dict[str, RunConfig] | None = None,
    ):
        self.cfg, self.base_url, self.model_path, self.token = cfg, base_url, model_path, token
        self.extra_sets = extra_sets or {}
        self.kept: int | None = None  # the version copied to `best_adapter`

    def of(self, version: int, cfg: RunConfig | None = None) -> dict:
        from app.evaluate import evaluate

        name = adapter_name(version, self.cfg.fleet_run)
        return evaluate(cfg or self.cfg, self.base_url, self.model_path, name, self.token, judged=cfg is None)

    def during(self, version: int, heldout: dict | None = None) -> Measured:
        """`version` on the held-out split (unless measured already: `heldout`) and on each extra set, all at once:
        while any set has requests in flight, the fleet keeps the version loaded however many newer ones arrive
        (`deployments.replica.adapter_slots`), where one set after another would leave it a gap to be evicted in,
        and then gone with the bucket's gc."""
        with ThreadPoolExecutor(len(self.extra_sets) + 1, thread_name_prefix="eval-set") as pool:
            own = None if heldout else pool.submit(self.of, version)
            extra = {name: pool.submit(self.of, version, cfg) for name, cfg in self.extra_sets.items()}
            heldout = heldout or own.result()
            accuracy = {name: future.result()["accuracy"] for name, future in extra.items()}
        return Measured(heldout["accuracy"], heldout.get("lost", 0), accuracy, heldout.get("judge_agreement", {}))

    @property
    def best_adapter(self) -> Path:
        return self.cfg.run_dir / "best_adapter"

    def keep(self, version: int) -> None:
        """Copy `version` out of the bucket to `best_adapter` (the bucket's gc removes old versions), replacing the
        one kept before; a PEFT folder, which `spotrl eval` evaluates and any PEFT loader loads."""
        from core.bucket.store import AdapterStore

        staging = self.cfg.run_dir / f".best_adapter-v{version}"
        shutil.rmtree(staging, ignore_errors=True)
        AdapterStore.from_config(self.cfg).fetch(version, dest=staging)
        shutil.rmtree(self.best_adapter, ignore_errors=True)
        staging.rename(self.best_adapter)
        self.kept = version

    def summary(self, points: list[EvalPoint], counts: dict[str, int]) -> dict:
        """The evaluation curve's part of the summary; with `eval.keep_best`, the best version kept (the final one,
        when it is the best, is copied now)."""
        out = eval_summary(points, counts, None)
        if self.cfg.eval.keep_best and out["best_version"] is not None and self.kept != out["best_version"]:
            try:
                self.keep(out["best_version"])
            except Exception as e:  # noqa: BLE001 - gone from the bucket: the summary names the version kept
                log.warning("could not keep version %s as the best adapter: %s", out["best_version"], e)
        out["best_adapter_version"] = self.kept
        out["best_adapter"] = str(self.best_adapter) if self.kept is not None else None
        return out

    def of_teacher(self, teacher) -> dict:
        """The teacher's held-out accuracy, measured as the student's (where it is served, under its name)."""
        from app.evaluate import evaluate

        token = teacher.token.value if teacher.token else None
        return evaluate(self.cfg, teacher.url, self.model_path, teacher.model, token, context=teacher.context)

    def baseline(self, resume: ResumePoint) -> dict:
        kept = self.cfg.run_dir / "heldout_before.json"
        if resume.step > 0:
            print(resumed_line(self.cfg, resume.step, resume.policy_version), file=sys.stderr)
            if kept.is_file():
                return json.loads(kept.read_text())
        before = self.of(resume.policy_version)
        log.info("held-out accuracy before: %.3f (%s)%s", before["accuracy"], before["model"], lost_note(before))
        if resume.step == 0:
            kept.write_text(json.dumps(before))
        return before
