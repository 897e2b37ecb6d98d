"""Checkpoints that move between strategies, and training that survives crashes and preemption.

``tf.train.Checkpoint`` / ``CheckpointManager`` and ``tf.distribute``'s preemption handling for
phalanx. A checkpoint saved under one strategy restores under any other, with any number of
replicas, or in plain PyTorch (:func:`load_state`); it is written once, by the chief, and
atomically; loading it never runs code from the file.

Example (every process runs this; see docs/checkpoints.md)::

    import phalanx as px
    from phalanx.checkpoint import Checkpoint, CheckpointManager, Counter, InputPosition

    with strategy.scope():
        model, optimizer = make_model(), make_optimizer()
        step, position = Counter(), InputPosition()
        ckpt = Checkpoint(model=model, optimizer=optimizer, step=step, input=position)
    manager = CheckpointManager(ckpt, "/shared/ckpts", max_to_keep=3)
    manager.restore_or_initialize()

Modules: :mod:`~phalanx.checkpoint.checkpoint` (Checkpoint, load_state, latest_checkpoint),
:mod:`~phalanx.checkpoint.manager`, :mod:`~phalanx.checkpoint.state` (Counter, InputPosition),
:mod:`~phalanx.checkpoint.preemption`, :mod:`~phalanx.checkpoint.storage` (the format and atomic
writes), :mod:`~phalanx.checkpoint.codec` (state trees to JSON and tensors),
:mod:`~phalanx.checkpoint.coordination` (who writes), :mod:`~phalanx.checkpoint.distributed`
(DTensor state: each replica writes its shards with torch.distributed.checkpoint),
:mod:`~phalanx.checkpoint.sharded_variables` (the extension point for sharded variables),
:mod:`~phalanx.checkpoint.keras_objects` (Keras objects by object graph, deferred restoration).
"""

from phalanx.checkpoint.checkpoint import Checkpoint, LoadStatus, latest_checkpoint, load_state
from phalanx.checkpoint.errors import (
    CheckpointError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    UnsafeCheckpointError,
    UnsupportedStateError,
)
from phalanx.checkpoint.manager import CheckpointManager
from phalanx.checkpoint.preemption import PreemptionCheckpointHandler, TerminationConfig
from phalanx.checkpoint.sharded_variables import register_sharded_type
from phalanx.checkpoint.state import Counter, InputPosition

__all__ = [
    "Checkpoint",
    "CheckpointError",
    "CheckpointManager",
    "CheckpointMismatchError",
    "CheckpointNotFoundError",
    "CorruptCheckpointError",
    "Counter",
    "InputPosition",
    "LoadStatus",
    "PreemptionCheckpointHandler",
    "TerminationConfig",
    "UnsafeCheckpointError",
    "UnsupportedStateError",
    "latest_checkpoint",
    "load_state",
    "register_sharded_type",
]
