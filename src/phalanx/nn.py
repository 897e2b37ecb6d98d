"""``phalanx.nn``: TF's ``tf.nn`` helpers for losses in synchronous training.

The names a TF program uses as ``tf.nn.compute_average_loss`` and
``tf.nn.scale_regularization_loss``, and the warning and marker that go with them; they are
defined in :mod:`phalanx.core.losses`, which explains the scaling.

Example:
    >>> import torch, phalanx as px
    >>> px.nn.compute_average_loss(torch.tensor([1.0, 2.0, 3.0]), global_batch_size=6)
    tensor(1.)
"""

from phalanx.core.losses import LossScaleWarning, compute_average_loss, mark_loss_scaled, scale_regularization_loss

__all__ = ["LossScaleWarning", "compute_average_loss", "mark_loss_scaled", "scale_regularization_loss"]
