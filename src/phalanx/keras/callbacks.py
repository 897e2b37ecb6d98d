"""Callbacks under a strategy: what runs once, and what every replica must agree on.

Every replica runs ``fit`` (one process per replica), so every replica has the callbacks the
program passed. Two kinds need care:

* **Writers** (``ModelCheckpoint``, ``TensorBoard`` (Keras' and :class:`TensorBoard`, phalanx's
  torch-backend one, importable from here), :class:`Trackers` (``fit``'s metrics to the trackers
  of a ``phalanx.summary`` writer), ``CSVLogger``, ``RemoteMonitor``,
  ``BackupAndRestore``, the progress bar) run on the chief only, so no two processes write the
  same file. The others get the rest of the list; ``History`` stays everywhere (the logs it
  records are the same on every replica).
* **Restoring.** ``BackupAndRestore`` restores on the chief (from its ``backup_dir``, which the
  other workers need not see); the coordinator then broadcasts the chief's weights, optimizer
  state and initial epoch, so every replica resumes from the same state. ``fit`` returns on every
  replica only after the chief's callbacks finished their ``on_train_end``.
* **Stopping.** A callback that sets ``model.stop_training`` on one replica would leave that
  replica out of the next step's collectives while the others wait for it. The
  :class:`Coordinator` appended to every replica's list makes the decision collective: at each
  epoch end (and at each batch end when any replica has a callback that may stop mid-epoch)
  every replica contributes its ``stop_training`` and all stop if any asked to.

The coordinator also makes every replica's random state the chief's at each epoch begin, so
shuffled inputs (arrays, ``DataLoader(shuffle=True)``, ``PyDataset``) produce the same global
batches on every replica before each replica takes its slice. In an elastic job it is where a
replacement joins ``fit``: its train begin, the members' next epoch begin
(:mod:`phalanx.keras.joining`).

Example (each replica runs this; only the chief writes ``best.weights.h5``)::

    with strategy.scope():
        model = keras.Sequential([keras.Input((10,)), keras.layers.Dense(1)])
        model.compile("sgd", "mse")
    model.fit(x, y, epochs=20, callbacks=[keras.callbacks.EarlyStopping(patience=2),
                                          keras.callbacks.ModelCheckpoint("best.weights.h5",
                                                                          save_weights_only=True)])
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING, Any

import keras
import numpy as np
import torch

from phalanx._compat import keras as compat_keras
from phalanx.comm.elastic import on_membership_change
from phalanx.keras import joining
from phalanx.keras.tensorboard import TensorBoard
from phalanx.keras.trackers import Trackers
from phalanx.values import ReduceOp

if TYPE_CHECKING:
    from phalanx.core.strategy import Strategy

_cb = keras.callbacks

# Callbacks that write files or the terminal; they run on the chief only.
CHIEF_ONLY: tuple[type, ...] = tuple(
    c
    for c in (
        getattr(_cb, name, None)
        for name in (
            "ModelCheckpoint",
            "TensorBoard",
            "CSVLogger",
            "RemoteMonitor",
            "ProgbarLogger",
            "BackupAndRestore",
            "OrbaxCheckpoint",
        )
    )
    if c is not None
) + (TensorBoard, Trackers)

# Callbacks that may change the training state at train begin (restore a backup), on the chief.
RESTORING: tuple[type, ...] = tuple(c for c in (getattr(_cb, "BackupAndRestore", None),) if c is not None)

# Built-in callbacks known never to set stop_training between batches; anything else that acts
# between batches makes the replicas agree after every batch.
_NEVER_STOP_MID_EPOCH: tuple[type, ...] = tuple(
    c
    for c in (
        getattr(_cb, name, None)
        for name in (
            "ProgbarLogger",
            "History",
            "ModelCheckpoint",
            "TensorBoard",
            "CSVLogger",
            "RemoteMonitor",
            "LearningRateScheduler",
            "ReduceLROnPlateau",
            "BackupAndRestore",
            "EarlyStopping",
            "SwapEMAWeights",
            "OrbaxCheckpoint",
        )
    )
    if c is not None
) + (TensorBoard, Trackers)

_BATCH_HOOKS = ("on_batch_begin", "on_batch_end", "on_train_batch_begin", "on_train_batch_end")


def _overrides(callback: Any, name: str) -> bool:
    method = getattr(callback, name, None)
    return getattr(method, "__func__", method) is not getattr(keras.callbacks.Callback, name)


def may_stop_mid_epoch(callbacks: list[Any]) -> bool:
    """Whether any callback acts between batches and is not known to leave ``stop_training`` alone."""
    return any(
        not isinstance(cb, _NEVER_STOP_MID_EPOCH) and any(_overrides(cb, h) for h in _BATCH_HOOKS) for cb in callbacks
    )


def for_replica(callbacks: list[Any], is_chief: bool) -> list[Any]:
    """The callbacks this replica runs: all on the chief, all but the writers elsewhere.

    A phalanx :class:`TensorBoard` that profiles stays on every replica: each writes its own
    trace (its summary writers still write on the chief only).
    """
    if is_chief:
        return list(callbacks)
    return [cb for cb in callbacks if not isinstance(cb, CHIEF_ONLY) or (isinstance(cb, TensorBoard) and cb.profiles)]


class Coordinator(keras.callbacks.Callback):
    """Agrees on ``stop_training`` and aligns random and restored state across replicas; appended last.

    Args:
        strategy: the model's strategy.
        callbacks: *this* replica's callbacks as the program passed them (before the chief-only
            ones are removed).
        adapter: the model's :class:`~phalanx.keras.sync_adapter.SyncAdapter`, told when a
            replacement joins ``fit`` (an elastic job's); None: no replacement joins this ``fit``.
    """

    def __init__(self, strategy: "Strategy", callbacks: list[Any], adapter: Any = None) -> None:
        super().__init__()
        self._strategy = strategy
        self._adapter = adapter
        self._joined: tuple[int | None] | None = None  # a replacement's initial epoch before it joined
        self._local_mid_epoch = may_stop_mid_epoch(callbacks)
        self._mid_epoch = self._local_mid_epoch
        self._restores = bool(strategy.extended.should_checkpoint) and any(
            isinstance(cb, RESTORING) for cb in callbacks
        )
        # An elastic job's changes of group reach the callbacks that define on_membership_change(change).
        self._told = [cb for cb in callbacks if callable(getattr(cb, "on_membership_change", None))]
        self._stop_telling: Any = None

    def _sum(self, values: list[float]) -> torch.Tensor:
        ext = self._strategy.extended
        return ext.all_reduce([torch.tensor(values, dtype=torch.float64)], ReduceOp.SUM)[0]

    def _agree_on_stop(self) -> None:
        if self._strategy.num_replicas_in_sync > 1:
            self.model.stop_training = bool(self._sum([float(bool(self.model.stop_training))])[0] > 0)

    def _membership_changed(self, change: Any) -> None:
        for cb in self._told:
            cb.on_membership_change(change)

    def _agree_on_flags(self, restores: bool) -> bool:
        """Agrees whether anyone needs a decision after every batch; returns whether anyone restored."""
        flags = self._sum([float(self._local_mid_epoch), float(restores)])
        self._mid_epoch = bool(flags[0] > 0)
        return bool(flags[1] > 0)

    def _regrouped(self) -> None:
        """A replacement joined (this replica, or another): the adapter looks again at what its
        steps keep per group, and the grown group agrees on the flags, as at train begin."""
        self._adapter.regrouped()
        self._agree_on_flags(False)

    def on_train_begin(self, logs: dict | None = None) -> None:
        if self._told and getattr(self._strategy.extended, "elastic", False):
            self._stop_telling = on_membership_change(self._membership_changed)  # a replacement's join too
        if self._adapter is not None and joining.joining(self._strategy):
            # A replacement: Keras built the model and its optimizer; it joins the group's next
            # epoch boundary with replica 0's state, and starts fit at that epoch.
            self._joined = (compat_keras.initial_epoch(self.model),)
            self._adapter.adopt_alone()
            joining.join(self._strategy, self.model)
            self._regrouped()
        # Replicas may have been given different callbacks (e.g. some only on the chief): agree
        # once whether anyone needs a decision after every batch, and whether the chief restored.
        elif self._strategy.num_replicas_in_sync > 1 and self._agree_on_flags(self._restores):
            broadcast_training_state(self._strategy, self.model)

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        # A replacement that asked (in its train begin) joins here, before the random state is
        # aligned: its epochs then draw the group's shuffles.
        if self._adapter is not None and joining.admit(self._strategy, self.model, epoch, self._adapter.join_refusal):
            self._regrouped()
        sync_random_state(self._strategy)

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        if self._mid_epoch:
            self._agree_on_stop()

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        self._agree_on_stop()

    def on_train_end(self, logs: dict | None = None) -> None:
        if self._stop_telling is not None:
            self._stop_telling()
            self._stop_telling = None
        if self._joined is not None:  # a later fit starts where its caller says, as before the join
            compat_keras.set_initial_epoch(self.model, self._joined[0])
            self._joined = None
        # A barrier: fit returns on every replica after the chief's writers finished (its last
        # checkpoint is complete, BackupAndRestore's backup is deleted), so any replica may read
        # what the chief wrote.
        if self._strategy.num_replicas_in_sync > 1:
            self._sum([0.0])


def broadcast_training_state(strategy: "Strategy", model: Any) -> None:
    """Makes the model's weights, its optimizer's state and its initial epoch the chief's (a collective)."""
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None and not optimizer.built:
        # A restoring chief has built it (to load its state); build it everywhere, so that the
        # same variables are broadcast. Keras would build it at the first step anyway.
        optimizer.build(model.trainable_variables)
    variables = list(model.weights) + (list(optimizer.variables) if optimizer is not None else [])
    initial_epoch = compat_keras.initial_epoch(model)
    epoch = torch.tensor([-1 if initial_epoch is None else int(initial_epoch)], dtype=torch.int64)
    with torch.no_grad():
        strategy.extended.broadcast([v.value for v in variables] + [epoch])
    compat_keras.set_initial_epoch(model, None if int(epoch[0]) < 0 else int(epoch[0]))


def sync_random_state(strategy: "Strategy") -> None:
    """Sets torch's, numpy's and Python's global random state to the chief's (a collective).

    Keras shuffles arrays with torch's global generator (and ``PyDataset`` with Python's), so
    after this every replica draws the same permutation and the global batches agree.
    """
    if strategy.num_replicas_in_sync == 1:
        return
    torch_state = torch.get_rng_state()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    version, py_keys, py_gauss = random.getstate()
    ints = torch.tensor([pos, has_gauss, version, py_gauss is not None, *keys.tolist(), *py_keys], dtype=torch.int64)
    floats = torch.tensor([cached, py_gauss or 0.0], dtype=torch.float64)
    strategy.extended.broadcast([torch_state, ints, floats])
    torch.set_rng_state(torch_state)
    values = ints.tolist()
    n_keys = len(keys)
    np.random.set_state(
        (kind, np.array(values[4 : 4 + n_keys], dtype=np.uint32), values[0], values[1], float(floats[0]))
    )
    random.setstate((values[2], tuple(values[4 + n_keys :]), float(floats[1]) if values[3] else None))
