"""The Tinker SDK's built-in losses, each a plain function of one datum's per-token tensors, as Tinker documents it.

A Tinker client picks a loss by name (`forward_backward(data, "importance_sampling")`) and every datum carries what
the loss needs (`loss_fn_inputs`, `contracts.tinker.LOSS_INPUTS`). Each loss is a *sum* over the datum's tokens (Tinker
never normalises: the client scales its advantages or weights), and the batch's loss is the sum over its datums. With
`target` the learner's log-probs of `target_tokens` and `sampling` the sampler's (`loss_fn_inputs["logprobs"]`):

- `cross_entropy`: `-(target * weights).sum()`;
- `importance_sampling`: `-(exp(target - sampling) * advantages).sum()`;
- `ppo`: `-min(ratio * A, clip(ratio, low, high) * A).sum()`, `low`/`high` = `clip_low_threshold` (0.8) and
  `clip_high_threshold` (1.2);
- `cispo`: `-(detach(clip(ratio, low, high)) * target * A).sum()`;
- `dro`: `-(target * A - beta / 2 * (target - sampling) ** 2).sum()`, `beta` from the config (0.05);
- `gspo` (GSPO-token): the sequence ratio `s = exp(mean(detach(target) - sampling))` over the tokens
  `sequence_ratio_mask` marks; each token's ratio `detach(s) * exp(target - detach(target))` (s's value, its own
  gradient), then `ppo`'s clipped objective on it, with `ppo`'s `clip_low_threshold` and `clip_high_threshold`.

`forward_backward_custom` needs nothing here: the SDK runs it as a forward pass and a `cross_entropy` backward whose
weights are the custom loss's gradient.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from contracts.tinker import LOSS_CONFIG, LOSS_INPUTS


class LossInputError(ValueError):
    """A datum or a config that the named loss cannot use (a missing input, a length that does not match)."""


def check_loss(loss_fn: str, config: Mapping[str, float]) -> dict[str, float]:
    """The loss's config with Tinker's defaults filled in; LossInputError for an unknown loss or config key."""
    if loss_fn not in LOSS_INPUTS:
        raise LossInputError(f"loss_fn {loss_fn!r} is not supported here; supported: {', '.join(LOSS_INPUTS)}")
    defaults = LOSS_CONFIG[loss_fn]
    unknown = sorted(set(config) - set(defaults))
    if unknown:
        raise LossInputError(f"loss_fn_config for {loss_fn}: unknown keys {unknown}; it takes {sorted(defaults)}")
    return {**defaults, **{k: float(v) for k, v in config.items()}}


def check_inputs(loss_fn: str, length: int, inputs: Mapping[str, object]) -> None:
    """LossInputError unless every input `loss_fn` reads is there with one value per position."""
    for name in LOSS_INPUTS[loss_fn]:
        values = inputs.get(name)
        if values is None:
            raise LossInputError(f"{loss_fn} needs loss_fn_inputs[{name!r}] (one value per target token)")
        if len(values) != length:  # type: ignore[arg-type]
            raise LossInputError(f"loss_fn_inputs[{name!r}] has {len(values)} values for {length} target tokens")  # type: ignore[arg-type]
    if loss_fn == "gspo" and not any(float(v) != 0 for v in inputs["sequence_ratio_mask"]):  # type: ignore[union-attr]
        raise LossInputError(
            "gspo: loss_fn_inputs['sequence_ratio_mask'] marks no token to take the sequence ratio over"
        )


def datum_loss(
    loss_fn: str, target: torch.Tensor, inputs: Mapping[str, torch.Tensor], config: Mapping[str, float]
) -> torch.Tensor:
    """One datum's loss (a scalar, summed over its tokens) from the learner's log-probs `target` of its targets."""
    if loss_fn == "cross_entropy":
        return -(target * inputs["weights"]).sum()
    sampling, advantages = inputs["logprobs"], inputs["advantages"]
    ratio = torch.exp(target - sampling)
    if loss_fn == "importance_sampling":
        return -(ratio * advantages).sum()
    if loss_fn == "gspo":  # every token carries the sequence's ratio, with the gradient of its own log-prob
        in_ratio = inputs["sequence_ratio_mask"] != 0
        sequence_log_ratio = (target.detach() - sampling)[in_ratio].mean()
        ratio = torch.exp(sequence_log_ratio + target - target.detach())
    if loss_fn in ("ppo", "gspo"):
        clipped = torch.clamp(ratio, config["clip_low_threshold"], config["clip_high_threshold"])
        return -torch.minimum(ratio * advantages, clipped * advantages).sum()
    if loss_fn == "cispo":
        clipped = torch.clamp(ratio, config["clip_low_threshold"], config["clip_high_threshold"]).detach()
        return -(clipped * target * advantages).sum()
    if loss_fn == "dro":
        return -(target * advantages - 0.5 * config["beta"] * (target - sampling) ** 2).sum()
    raise LossInputError(f"loss_fn {loss_fn!r} is not supported here")
