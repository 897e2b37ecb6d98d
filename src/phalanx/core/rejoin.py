"""A replacement replica joins an elastic job's group at a step boundary, from a live peer's state.

``phalanx run -n 3 --min-nproc 2`` starts a replacement for a lost replica. It runs the program
from the top, alone (its collectives are its own), until its first ``strategy.run``; there it asks
to join (:meth:`~phalanx.comm.elastic.ElasticCommunicator.join`). The group counts it at a step's
vote and admits it at the next step boundary (:meth:`~phalanx.comm.elastic.ElasticCommunicator.grow`),
where every member and the replacement run :func:`admit`: the new process group, then replica 0's
state, never read from disk:

* every variable created in the strategy's scope (parameters, buffers), broadcast;
* the state of the torch optimizers the step function names (as the optimizers of a TF custom
  loop are found), its tensors broadcast, its structure sent as JSON through the job's store
  (nothing is unpickled);
* the step counter, and the input position: the replacement's distributed iterator reads and drops
  the batches the group has trained on in this pass, and the step runs on the group's batch, cut
  for the grown group.

A replacement whose program or model differs (another script; another number, shape or dtype of
variables) is refused by name (:class:`~phalanx.errors.ElasticRecoveryError`); one that finds the
job ended before it was admitted exits 0.

Keras ``fit`` on arrays has no input position within an epoch: there a replacement joins at an
epoch boundary instead (:mod:`phalanx.keras.joining`). While the group is in ``fit``
(:func:`at_epoch_boundaries`) its steps leave the requests pending for the next epoch's begin, and
a group outside ``fit`` leaves a Keras replacement's request pending (it joins at the group's next
epoch of ``fit``, or exits 0 when the job ends).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import sys
import weakref
from collections.abc import Iterable, Iterator
from typing import Any, Callable, NoReturn

import torch

from phalanx.core.named_objects import objects_used_by
from phalanx.errors import ElasticRecoveryError
from phalanx.input import global_batch

# Why a replacement cannot join a group whose steps take no batches of a distributed dataset.
_NO_POSITION = (
    "the group's steps take no batches of a distributed dataset (Keras fit on arrays, say), so a "
    "replacement could not start at the group's place in its input"
)
# The strategies' extended objects whose replicas are in Keras fit: a replacement joins at an epoch boundary.
_IN_FIT: "weakref.WeakSet[Any]" = weakref.WeakSet()


@contextlib.contextmanager
def at_epoch_boundaries(ext: Any) -> Iterator[None]:
    """While the replicas of ``ext`` are in Keras ``fit``: its steps admit no replacement (fit admits
    them when an epoch begins, :mod:`phalanx.keras.joining`)."""
    inside = ext in _IN_FIT
    _IN_FIT.add(ext)
    try:
        yield
    finally:
        if not inside:
            _IN_FIT.discard(ext)


def _waits(ext: Any) -> bool:
    """Whether the replacements that asked wait for an epoch boundary of Keras fit: the group is in
    fit (those that asked to join at a step are refused there), or all asked to join fit."""
    if ext in _IN_FIT:
        return True
    asked = ext.communicator.pending()
    return bool(asked) and all(a.get("at") == "epoch" for a in asked)


def job_ended() -> NoReturn:
    """A replacement found the job ended before it was admitted: nothing to do, it exits 0."""
    sys.stderr.write("phalanx: the job ended before this replacement replica could join; nothing to do\n")
    sys.stderr.flush()
    raise SystemExit(0)


def digest(ext: Any, tensors: Iterable[torch.Tensor] | None = None) -> str:
    """What a replacement must share with the group (JSON): its program (the hash of the main
    script's source, where there is one) and the shapes and dtypes of the variables created in
    ``ext``'s scope, in creation order (or of ``tensors``, the state a join sends)."""
    main = getattr(sys.modules.get("__main__"), "__file__", None)
    try:
        with open(main, "rb") as f:  # type: ignore[arg-type]
            program = hashlib.sha256(f.read()).hexdigest()
    except (OSError, TypeError):
        program = ""  # -c, a notebook: no file to compare
    tensors = ext.variable_sync.created.values() if tensors is None else tensors
    variables = [[list(t.shape), str(t.dtype).removeprefix("torch.")] for t in tensors]
    return json.dumps({"program": program, "variables": variables})


def admit(ext: Any, fn: Callable[..., Any], args: tuple, kwargs: dict, info: Any) -> tuple[tuple, dict, Any]:
    """Joins (a replacement) or admits the replacements that asked (a member), and brings the newcomers
    up to date; returns the step's arguments and their batch's tag (a replacement's caught up with
    the group's batch)."""
    comm = ext.communicator
    newcomer = comm.joining
    if newcomer:
        if not comm.join(digest(ext)):
            job_ended()
    elif _waits(ext) or not comm.grow(digest(ext), None if info is not None else _NO_POSITION):
        return args, kwargs, info  # none joins here (refused, or at an epoch of fit): the group stays as it was
    ext.gradient_sync.regrouped()
    ext.consistency.regrouped()
    optimizers = objects_used_by(fn, torch.optim.Optimizer)
    key = f"state/{comm.generation}"
    if comm.rank == 0:
        states = [_skeleton(o.state_dict()) for o in optimizers]
        place = {"step": ext.step, "ordinal": info.ordinal if info is not None else None}
        comm.store.set(key, json.dumps({**place, "optimizers": [s for s, _ in states]}))
        tensors = [t for _, ts in states for t in ts]
    else:
        meta = json.loads(comm.store.get(key))
        states = [(s, _empty_like(s)) for s in meta["optimizers"]]
        tensors = [t for _, ts in states for t in ts]
    with torch.no_grad():
        ext.cross_replica.broadcast(list(ext.variable_sync.created.values()) + tensors)
    if newcomer:
        if len(optimizers) != len(meta["optimizers"]):
            raise ElasticRecoveryError(
                f"this replacement's step function names {len(optimizers)} optimizer(s), the group's "
                f"{len(meta['optimizers'])}",
                [],
            )
        for optimizer, (skeleton, values) in zip(optimizers, states):
            optimizer.load_state_dict(_rebuild(skeleton, values))
        ext.caught_up(meta["step"])
        if meta["ordinal"] is not None:
            (args, kwargs), caught = global_batch.catch_up((args, kwargs), meta["ordinal"])
            info = caught if caught is not None else info
    return args, kwargs, info


def _skeleton(value: Any) -> tuple[Any, list[torch.Tensor]]:
    """``value`` (an optimizer's state dict) as JSON with its tensors taken out, and the tensors."""
    tensors: list[torch.Tensor] = []

    def walk(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            # On the host: the others' buffers are (load_state_dict moves them to the parameters' device).
            tensors.append(v.detach().cpu())
            return {
                "__tensor__": len(tensors) - 1,
                "shape": list(v.shape),
                "dtype": str(v.dtype).removeprefix("torch."),
            }
        if isinstance(v, dict):
            return {"__dict__": [[walk(k), walk(x)] for k, x in v.items()]}
        if isinstance(v, (list, tuple)):
            return [walk(x) for x in v]
        return v

    return walk(value), tensors


def _empty_like(skeleton: Any) -> list[torch.Tensor]:
    """Receive buffers for the tensors of ``skeleton``, in the order :func:`_skeleton` took them."""
    found: list[tuple[int, torch.Tensor]] = []

    def walk(v: Any) -> None:
        if isinstance(v, dict) and "__tensor__" in v:
            found.append((v["__tensor__"], torch.empty(v["shape"], dtype=getattr(torch, v["dtype"]))))
        elif isinstance(v, dict):
            for k, x in v["__dict__"]:
                walk(k)
                walk(x)
        elif isinstance(v, list):
            for x in v:
                walk(x)

    walk(skeleton)
    return [t for _, t in sorted(found, key=lambda p: p[0])]


def _rebuild(skeleton: Any, tensors: list[torch.Tensor]) -> Any:
    def walk(v: Any) -> Any:
        if isinstance(v, dict) and "__tensor__" in v:
            return tensors[v["__tensor__"]]
        if isinstance(v, dict):
            return {walk(k): walk(x) for k, x in v["__dict__"]}
        if isinstance(v, list):
            return [walk(x) for x in v]
        return v

    return walk(skeleton)
