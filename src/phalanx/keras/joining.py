"""A replacement replica joins Keras ``fit`` at an epoch boundary (elastic jobs; docs/elastic.md).

``fit`` on arrays keeps its place in the data inside Keras' epoch iterator, which no peer can move
to the group's place in the middle of an epoch; so a replacement running ``fit`` joins where an
epoch begins (a custom loop's replacement joins at a step, :mod:`phalanx.core.rejoin`):

* The replacement asks in its ``fit``'s ``on_train_begin`` (:func:`join`): Keras has built the
  model, its optimizer and its metrics by then, so its state has the group's shapes, and it has
  not trained yet. It waits to be admitted.
* While they are in ``fit`` the members' steps leave its request pending
  (:func:`phalanx.core.rejoin.at_epoch_boundaries`); at the next ``on_epoch_begin`` every member
  admits it (:func:`admit`) if a step's vote counted it (every member read the same decision).
* Replica 0 then sends, never through pickle: every variable created in the strategy's scope, the
  model's variables (weights, seed states) and its Keras optimizers' (slots and ``iterations``, so
  learning-rate schedules go on), broadcast; the epoch the group is starting and its step count,
  as JSON in the job's store. The replacement's ``fit`` starts at that epoch (``History``, the
  callbacks' epochs and epoch-based schedules line up).
* In the same ``on_epoch_begin`` the coordinator makes every replica's random state replica 0's
  (:func:`~phalanx.keras.callbacks.sync_random_state`, a broadcast the replacement takes part in),
  so the replacement's epochs draw the group's shuffles.

A replacement whose program or model differs (the digest covers every tensor sent) is refused by
name, as at a step (:class:`~phalanx.errors.ElasticRecoveryError`); so is one whose group's ``fit``
reads an input whose place it could not take (:func:`unplaceable`).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from phalanx._compat import keras as compat_keras
from phalanx.core import rejoin
from phalanx.keras.batches import _is_distributed_input
from phalanx.keras.optimizer_adapter import held_optimizers

if TYPE_CHECKING:
    from phalanx.core.strategy import Strategy


def joining(strategy: "Strategy") -> bool:
    """Whether this replica is a replacement that has not joined its elastic job's group yet."""
    ext = strategy.extended
    return bool(getattr(ext, "elastic", False)) and bool(getattr(ext.communicator, "joining", False))


def unplaceable(x: Any, steps_per_epoch: Any) -> str | None:
    """Why a replacement could not start at the group's place in ``fit``'s input ``x``; None where
    every epoch reads ``x`` from its start (arrays, tensors, a ``DataLoader``, a ``PyDataset``), the
    shuffle drawn from the random state the replicas align as each epoch begins."""
    if _is_distributed_input(x):
        return f"the group's fit reads a {type(x).__name__}, whose place a replacement cannot take at an epoch boundary"
    if isinstance(x, Iterator):
        return (
            f"the group's fit reads a {type(x).__name__} (an iterator: it goes on across epochs), whose place "
            "a replacement cannot take"
        )
    if steps_per_epoch is not None:
        return (
            f"the group's fit has steps_per_epoch={steps_per_epoch!r}, so its epochs go on reading one "
            "iterator, whose place a replacement cannot take"
        )
    return None


def join(strategy: "Strategy", model: Any) -> None:
    """The replacement joins the group at its next epoch boundary and takes replica 0's state and
    the epoch to start at (``fit``'s ``initial_epoch``, set through the model as ``BackupAndRestore``
    sets it). Exits 0 if the job ends first.

    Raises:
        ElasticRecoveryError: the group refused it (another program or model), or never answered.
    """
    ext = strategy.extended
    comm = ext.communicator
    state = _state(ext, model)
    if not comm.join(rejoin.digest(ext, state), at="epoch"):
        rejoin.job_ended()
    place = json.loads(comm.store.get(_key(comm)))
    _receive(ext, state)
    ext.caught_up(place["step"])
    compat_keras.set_initial_epoch(model, place["epoch"])


def admit(strategy: "Strategy", model: Any, epoch: int, refusal: str | None) -> bool:
    """A member, as ``epoch`` begins: admits the replacements the last vote counted and sends them
    the group's state; whether the group grew (every member takes the same decision).
    ``refusal``: why none can join this ``fit`` (:func:`unplaceable`), or None."""
    ext = strategy.extended
    comm = ext.communicator
    if not getattr(ext, "elastic", False) or not comm.grow_pending:
        return False
    state = _state(ext, model)
    if not comm.grow(rejoin.digest(ext, state), refusal, at="epoch"):
        return False  # every replacement that asked was refused
    if comm.rank == 0:
        comm.store.set(_key(comm), json.dumps({"epoch": epoch, "step": ext.step}))
    _receive(ext, state)
    return True


def _key(comm: Any) -> str:
    """Where replica 0 writes the group's place, in the new generation's keys of the job's store."""
    return f"keras-join/{comm.generation}"


def _state(ext: Any, model: Any) -> list[torch.Tensor]:
    """The tensors replica 0 sends, in the same order on every replica: the model's variables, its
    optimizers' variables, then the other variables created in scope (each tensor once). The model's
    come first: those built lazily joined the members' scope records at their first steps, and
    join a replacement's only as it joins (:meth:`~phalanx.keras.sync_adapter.SyncAdapter.adopt_alone`)."""
    found: dict[int, torch.Tensor] = {}
    variables = [*model.variables, *(v for optimizer in held_optimizers(model) for v in optimizer.variables)]
    for variable in variables:
        found.setdefault(id(variable.value), variable.value)
    for tensor in ext.variable_sync.created.values():
        found.setdefault(id(tensor), tensor)
    return list(found.values())


def _receive(ext: Any, state: list[torch.Tensor]) -> None:
    """On the new group: resets what a step keeps per group, and makes ``state`` replica 0's."""
    ext.gradient_sync.regrouped()
    ext.consistency.regrouped()
    with torch.no_grad():
        ext.broadcast(state)
