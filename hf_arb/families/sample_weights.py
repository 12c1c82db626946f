"""Per-sample loss weights of a micro-batch, one reduction for every family: prior preservation's loss.

A batch may carry ``sample_weights`` ``(B,)``; every family's loss then reduces its per-sample losses ``l_i`` (each
the mean over the sample's elements, with the family's own per-sample weighting: ``--snr_gamma``, the SD3 weighting
schemes) to ``mean_i(w_i * l_i)`` instead of ``mean_i(l_i)`` (:func:`batch_mean`). Without ``sample_weights`` the
loss is exactly what it was.

Prior preservation (diffusers' dreambooth scripts) stacks ``n`` instance rows then ``m`` class rows and trains
``mean(instance losses) + prior_loss_weight * mean(class losses)``; upstream chunks the prediction and the target
in two halves. :func:`prior_sample_weights` gives the weights whose weighted mean is that sum: ``(n + m) / n`` for an
instance row and ``prior_loss_weight * (n + m) / m`` for a class row.

Imports torch only when a function runs (the families' detection does not load it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

__all__ = ["SAMPLE_WEIGHTS", "batch_mean", "prior_sample_weights"]

#: the batch key of the per-sample loss weights
SAMPLE_WEIGHTS = "sample_weights"


def prior_sample_weights(n_instance: int, n_class: int, prior_loss_weight: float) -> torch.Tensor:
    """float32 ``(n_instance + n_class,)``: a batch's weights for ``mean(instance) + weight * mean(class)``."""
    import torch

    if n_instance < 1 or n_class < 1:
        raise ValueError(f"A prior-preservation batch needs instance and class rows, got {n_instance} and {n_class}.")
    total = n_instance + n_class
    return torch.cat([torch.full((n_instance,), total / n_instance),
                      torch.full((n_class,), float(prior_loss_weight) * total / n_class)]).float()


def batch_mean(per_sample: torch.Tensor, weights: Any = None) -> torch.Tensor:
    """``per_sample.mean()``, or with ``weights`` ``(B,)`` the weighted ``(per_sample * weights).mean()``."""
    if weights is None:
        return per_sample.mean()
    return (per_sample * weights.to(per_sample.device, per_sample.dtype)).mean()
