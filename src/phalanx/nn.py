"""Loss scaling for synchronous training (``tf.nn.compute_average_loss`` and friends).

Gradients are *summed* across replicas, so each replica's loss must be divided by the global
batch size, not its own: the sum of the replicas' gradients is then the gradient of the mean loss
over the global batch, exactly what one device computes.

Example:
    >>> import torch, phalanx as px
    >>> px.nn.compute_average_loss(torch.tensor([1.0, 2.0, 3.0]), global_batch_size=6)
    tensor(1.)
"""

from __future__ import annotations

import torch

from phalanx import context


def compute_average_loss(per_example_loss: torch.Tensor, sample_weight: torch.Tensor | float | None = None,
                         global_batch_size: int | None = None) -> torch.Tensor:
    """Sums ``per_example_loss`` (times ``sample_weight``) and divides by the global batch size.

    Args:
        per_example_loss: this replica's losses, one per example (extra dimensions are summed).
        sample_weight: optional weights, broadcast against ``per_example_loss``.
        global_batch_size: the batch size over all replicas. Default: the size of the global
            batch the replica's input came from (exact for uneven last batches), else this
            replica's batch times ``num_replicas_in_sync``.

    Raises:
        ValueError: ``global_batch_size`` is not a positive integer.
    """
    loss = per_example_loss
    if sample_weight is not None:
        loss = loss * torch.as_tensor(sample_weight, dtype=loss.dtype, device=loss.device)
    if global_batch_size is None:
        strategy = context.get_strategy()
        global_batch_size = strategy.extended._global_batch_size  # friend: the global-batch channel (input)
        if global_batch_size is None:
            local = loss.shape[0] if loss.dim() > 0 else 1
            global_batch_size = local * strategy.num_replicas_in_sync
    if isinstance(global_batch_size, bool) or not isinstance(global_batch_size, int) or global_batch_size <= 0:
        raise ValueError(f"global_batch_size must be a positive int; received {global_batch_size!r}")
    return loss.sum() / global_batch_size


def scale_regularization_loss(regularization_loss: torch.Tensor) -> torch.Tensor:
    """Divides a regularization loss by the number of replicas, so its summed gradient is counted once."""
    return regularization_loss / context.get_strategy().num_replicas_in_sync
