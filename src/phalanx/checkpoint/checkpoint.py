"""``Checkpoint``: save the objects of a training program under one strategy, restore under any.

As ``tf.train.Checkpoint``: name the objects once, then ``save`` (numbered) or ``write`` (exact
path), and ``restore`` / ``read``. Objects may be

* anything with ``state_dict()`` / ``load_state_dict()``: modules, optimizers, LR schedulers,
  :class:`~phalanx.checkpoint.Counter`, :class:`~phalanx.checkpoint.InputPosition`;
* Keras objects (models, layers, optimizers, metrics, ``keras.Variable``): stored by their place
  in the object graph, as TF does, so a fresh copy of a model restores whatever Keras named its
  layers, and values for variables that do not exist yet (a Keras optimizer's slots, a model
  without an input shape) are restored when they are created (:mod:`~phalanx.checkpoint.keras_objects`);
* tensors (a parameter, a 0-d step tensor): restored in place with ``copy_``;
* sharded variables (:mod:`phalanx.checkpoint.sharded_variables`), stored as one full tensor;
* numbers, strings, None, and lists / tuples / dicts of those and of tensors: containers are
  restored in place where they can be, immutable values are replaced, so read them back as
  ``checkpoint.<name>``.

Parameters are plain tensors that are identical on every replica, and a checkpoint holds one
full copy of each, so the program that restores may use any strategy and any number of replicas,
or no strategy at all (:func:`load_state`). Saving is collective (all processes call it; the chief
writes, see :mod:`~phalanx.checkpoint.coordination`, which also says how a Checkpoint made
outside ``scope()`` finds its strategy); restoring is local (every process reads the files, which
must be on storage that all of them see).

Example:
    >>> import tempfile, torch
    >>> from phalanx.checkpoint import Checkpoint, Counter
    >>> model = torch.nn.Linear(2, 1)
    >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> ckpt = Checkpoint(model=model, optimizer=opt, step=Counter(5))
    >>> path = ckpt.save(tempfile.mkdtemp() + "/ckpt")
    >>> path.endswith("ckpt-1")
    True
    >>> ckpt.step.assign(9)
    9
    >>> status = ckpt.restore(path)
    >>> int(ckpt.step)
    5
"""

from __future__ import annotations

import os
import re
import shutil
from typing import Any, Callable

import torch

from phalanx.checkpoint import codec, distributed, keras_objects, sharded_variables, storage
from phalanx.checkpoint.coordination import Participants, find_strategy
from phalanx.checkpoint.errors import CheckpointError, CheckpointMismatchError
from phalanx.checkpoint.state import Counter
from phalanx.core import context
from phalanx.core.variable_sync import owner_of

_RESERVED = ("save_counter",)


class LoadStatus:
    """What a restore matched (``tf.train.Checkpoint.restore``'s status object).

    Attributes:
        restored: names of the objects restored.
        missing: objects of the Checkpoint that the file does not hold (left as they were).
        unused: objects in the file that the Checkpoint does not name.
    """

    def __init__(
        self,
        path: str | None,
        restored: list[str],
        missing: list[str],
        unused: list[str],
        deferred: list[keras_objects.Pending] | None = None,
        unmatched: list[str] | None = None,
    ) -> None:
        self.path, self.restored, self.missing = path, restored, missing
        self._unused = unused
        self._deferred = deferred or []
        self._unmatched = unmatched if unmatched is not None else []

    @property
    def pending(self) -> list[str]:
        """Objects whose saved values wait for their variables to be created (TF's deferred restoration).

        A Keras optimizer's slots appear at its first step, a model without an input shape at its
        first call; they receive the saved values then, before they are first used.
        """
        return [p.path for p in self._deferred if not p.done]

    @property
    def unused(self) -> list[str]:
        """Saved objects (and parts of Keras objects' graphs) that nothing here received."""
        return self._unused + self._unmatched

    def assert_consumed(self) -> "LoadStatus":
        """Raises unless every object was restored, every saved value was used and none is pending."""
        if self.path is None:
            raise CheckpointError("Nothing was restored (the path was None).")
        if self.missing or self.unused or self.pending:
            raise CheckpointMismatchError(
                self.path,
                f"objects not in the checkpoint: {self.missing}; "
                f"saved objects not restored: {self.unused}; "
                f"waiting for their variables to be created: {self.pending}",
            )
        return self

    def assert_existing_objects_matched(self) -> "LoadStatus":
        """Raises if an object of the Checkpoint had no saved value."""
        if self.missing:
            raise CheckpointMismatchError(self.path or "<none>", f"objects not in the checkpoint: {self.missing}")
        return self

    def expect_partial(self) -> "LoadStatus":
        return self

    def __repr__(self) -> str:
        return (
            f"LoadStatus(path={self.path!r}, restored={self.restored}, missing={self.missing}, "
            f"unused={self.unused}, pending={self.pending})"
        )


class Checkpoint:
    """Groups the objects to save; see the module docstring.

    Args:
        root: an object saved under the name ``"root"`` (TF's positional root).
        **objects: the objects to save, by name.

    Raises:
        ValueError: a name is reserved (``save_counter``) or starts with an underscore.
    """

    def __init__(self, root: Any = None, **objects: Any) -> None:
        object.__setattr__(self, "_objects", {})
        object.__setattr__(self, "_strategy", context.get_strategy() if context.has_strategy() else None)
        object.__setattr__(self, "_save_counter", Counter(0))
        if root is not None:
            objects = {"root": root, **objects}
        for name, obj in objects.items():
            self._check_name(name)
            self._objects[name] = obj

    # ---------------------------------------------------------------- objects
    @staticmethod
    def _check_name(name: str) -> None:
        if name in _RESERVED or name.startswith("_"):
            raise ValueError(f"Checkpoint object name {name!r} is reserved; choose another name")

    def _track(self, name: str, obj: Any) -> None:
        """Adds an object under a name users cannot pick (phalanx's own state, e.g. run counters)."""
        self._objects[name] = obj

    def __getattr__(self, name: str) -> Any:
        objects = self.__dict__.get("_objects", {})
        if name in objects:
            return objects[name]
        raise AttributeError(f"Checkpoint has no object {name!r}; it holds {sorted(objects)}")

    def __setattr__(self, name: str, value: Any) -> None:
        if name.startswith("_"):
            object.__setattr__(self, name, value)
            return
        self._check_name(name)
        self._objects[name] = value

    @property
    def save_counter(self) -> Counter:
        """How many times :meth:`save` was called (restored by :meth:`restore`, not :meth:`read`)."""
        return self._save_counter

    def _all_objects(self) -> dict[str, Any]:
        return {"save_counter": self._save_counter, **self._objects}

    def _participants(self) -> Participants:
        """Who takes part in this Checkpoint's saves (see :mod:`~phalanx.checkpoint.coordination`)."""
        return Participants.resolve(self._strategy, _owning_strategy(_owner(o) for o in self._objects.values()))

    # ---------------------------------------------------------------- saving
    def save(self, file_prefix: str) -> str:
        """Saves to ``{file_prefix}-{save_counter}`` after counting this save; returns that path.

        Collective: every process calls it. See :meth:`write`.
        """
        number = self._save_counter.assign_add(1)
        return self.write(f"{file_prefix}-{number}")

    def write(self, file_prefix: str, *, _after_commit: Callable[[], None] | None = None) -> str:
        """Writes a checkpoint at exactly ``file_prefix`` (a directory); returns its absolute path.

        Collective: every process calls it; the chief writes, and a process given a path of its
        own (TF's multi-worker ``write_filepath`` pattern) writes that one; all return once every
        file is on disk.

        Raises:
            CheckpointError: the chief's write failed (raised on every process).
            UnsupportedStateError: an object's state holds something that cannot be stored.
        """
        objects = self._all_objects()
        owners = {name: _owner(obj) for name, obj in objects.items()}
        who = Participants.resolve(self._strategy, _owning_strategy(owners.values()))
        # GPU replicas check the consistency guard one step late: never write a diverged state.
        who.strategy.extended.check_consistency()
        path = os.path.abspath(os.fspath(file_prefix))
        writes = who.writes(path)
        manifest_objects: dict[str, Any] = {}
        files: dict[str, dict[str, torch.Tensor]] = {}
        shards: dict[str, torch.Tensor] = {}  # DCP key -> DTensor, written by every replica
        for name, obj in objects.items():
            # Every process collects its state (a sharded variable may gather its shards); only
            # the writer copies tensors out.
            state = (owners[name] or who.strategy.extended).state_to_save(obj)
            doc, tensors = codec.encode(
                _state_of(obj, objects) if state is None else state, label=name, materialize=writes
            )
            entry: dict[str, Any] = {"kind": _kind(obj), "state": doc}
            sharded = {key: t for key, t in tensors.items() if distributed.is_distributed(t)}
            if sharded:
                entry["sharded"] = {
                    key: {"key": f"{name}/{key}", **distributed.describe(t)} for key, t in sharded.items()
                }
                shards.update({f"{name}/{key}": t for key, t in sharded.items()})
                tensors = {key: t for key, t in tensors.items() if key not in sharded}
            if tensors:
                entry["file"] = _file_name(name, files)
                files[entry["file"]] = tensors
            manifest_objects[name] = entry
        error: BaseException | None = None
        staging, staged = None, {}
        if shards:  # DTensors: every replica writes its own shards, no whole tensor anywhere
            staging, staged, error = distributed.write_shards(who, shards, path)
        if writes and error is None:
            try:
                # The chief's own path holds the shards; a worker given a path of its own (TF's
                # write_filepath) writes the other objects only there.
                storage.write_checkpoint(
                    path,
                    files,
                    {"objects": manifest_objects, "saved_by": who.describe()},
                    staging=staging,
                    staged=staged,
                )
                staging = None  # committed
                if _after_commit is not None:
                    _after_commit()
            except Exception as e:  # noqa: BLE001 - reported to every process below
                error = e
        if staging is not None:  # written, not committed (a failure, or process 0 is not a writer)
            shutil.rmtree(staging, ignore_errors=True)
        if who.any(error is not None):
            if error is not None:
                raise error
            raise CheckpointError(
                f"Another process failed to write the checkpoint {path!r} (the chief's, or its own).",
                hint="see the other replicas' logs (the chief's output, or LOGDIR/<run>/replica_<k>.log) for the error",
            )
        return path

    # ---------------------------------------------------------------- restoring
    def restore(self, save_path: str | None) -> LoadStatus:
        """Restores every object (and ``save_counter``) from ``save_path``; None does nothing.

        Raises:
            CheckpointNotFoundError: ``save_path`` holds no complete checkpoint.
            CheckpointMismatchError: a saved value does not fit its object (shape, keys).
            CorruptCheckpointError: a file (the manifest, its digest file or a tensor file)
                changed after it was written; names the file and why. Nothing was restored.
            UnsafeCheckpointError: a file is not a clean tensor file.
        """
        return self._restore(save_path, self._all_objects())

    def read(self, save_path: str) -> LoadStatus:
        """Like :meth:`restore`, but leaves ``save_counter`` alone (TF's ``read``)."""
        return self._restore(save_path, dict(self._objects))

    def _restore(self, save_path: str | None, live: dict[str, Any]) -> LoadStatus:
        if save_path is None:
            return LoadStatus(None, [], sorted(live), [])
        path = os.path.abspath(os.fspath(save_path))
        saved, manifest = _load(path, set(live))
        owners = {name: _owner(obj) for name, obj in live.items()}
        try:  # restoring is local (no collective), so any strategy, or none, will do
            extended = find_strategy(self._strategy, _owning_strategy(owners.values())).extended
        except CheckpointError:
            extended = context.get_strategy().extended
        restored, changed = [], {id(extended): extended}
        deferred: list[keras_objects.Pending] = []
        unmatched: list[str] = []
        prepared: dict[str, tuple[bool, Any]] = {}
        for name, state in saved.items():
            # Everything is read (and verified) before anything is restored.
            graph = keras_objects.is_keras_object(live[name]) and keras_objects.is_graph_state(state)
            if not graph:
                # A strategy that shards the object cuts each whole tensor to this replica's part,
                # and reads tensors that were written sharded into its own shards.
                state = (owners[name] or extended).state_to_restore(live[name], state)
            # What it left of tensors written sharded is read whole (Mirrored, one device).
            prepared[name] = (graph, distributed.materialize(state))
        for name, (graph, state) in prepared.items():
            if graph:
                # Wherever the file holds a part of the graph, it is restored (an optimizer saved
                # as model.optimizer restores whether or not this Checkpoint also names it).
                later, unused = keras_objects.restore(name, live[name], state, set())
                deferred += later
                unmatched += unused
                replacement = _IN_PLACE
            else:
                replacement = _restore_into(name, live[name], state)
            if replacement is not _IN_PLACE:
                self._objects[name] = replacement
            else:
                owner = owners[name] or extended
                owner.after_restore(live[name])
                changed[id(owner)] = owner
            restored.append(name)
        for ext in changed.values():
            # CONSISTENCY HOOK (the one call site): the parameters changed outside a step, so the
            # replicas' parameter fingerprint guard checks them again at the next step.
            hook = getattr(ext, "mark_parameters_changed", None)
            if hook is not None:
                hook()
        return LoadStatus(
            path,
            restored,
            sorted(set(live) - set(saved)),
            sorted(set(manifest["objects"]) - set(live)),
            deferred,
            unmatched,
        )

    def __repr__(self) -> str:
        return f"Checkpoint({', '.join(sorted(self._objects))})"


def load_state(path: str, names: set[str] | None = None) -> dict[str, Any]:
    """Reads a checkpoint into plain state dicts, with no strategy and no live objects.

    This is how plain PyTorch reads a phalanx checkpoint::

        state = phalanx.checkpoint.load_state("/ckpts/ckpt-7")
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        step = state["step"]["value"]          # a Counter's state

    (A module's file is also its ``state_dict`` for ``torch.load(path + "/model.pt", weights_only=True)``.)

    Args:
        path: the checkpoint directory.
        names: read only these objects (default: all).

    Returns:
        ``{name: state}``: what each object's ``state_dict()`` returned (tensors on the CPU),
        or the tensor / value itself; for a Keras object, its object graph:
        ``{"vars": {"0": tensor, ...}, "children": {"dense": {...}, "optimizer": {...}}}``.
        Tensors written sharded (FullyShardedStrategy) come back whole, as from any other strategy.
    """
    return distributed.materialize(_load(os.path.abspath(os.fspath(path)), names)[0])


def _load(path: str, names: set[str] | None) -> tuple[dict[str, Any], dict[str, Any]]:
    """The saved state of each object; a tensor written sharded is a :class:`distributed.Stored`
    placeholder, read later into the layout its object needs."""
    manifest = storage.read_manifest(path)
    files: dict[str, dict[str, torch.Tensor]] = {}
    out: dict[str, Any] = {}
    source = distributed.Source(path, manifest)
    for name, entry in manifest["objects"].items():
        if names is not None and name not in names:
            continue
        tensors: dict[str, torch.Tensor] = {}
        if "file" in entry:
            file = entry["file"]
            if file not in files:
                record = manifest["files"].get(file)
                if record is None:
                    raise CheckpointMismatchError(name, f"the manifest names file {file!r} but records no such file")
                files[file] = storage.load_tensors(path, file, record)
            tensors = files[file]
        if isinstance(entry.get("sharded"), dict):
            stored = {key: source.stored(name, key, ref) for key, ref in entry["sharded"].items()}
            tensors = {**tensors, **stored}
        out[name] = codec.decode(entry["state"], tensors)
    return out, manifest


def latest_checkpoint(directory: str) -> str | None:
    """The newest intact checkpoint in ``directory``, or None.

    Directories without a manifest (a save that crashed) are not checkpoints. The newest
    checkpoint is verified (its manifest against its digest file, every other file's size and
    SHA-256 against the manifest); a damaged one is skipped with a warning naming it, the file
    and why, and the next newest is tried.
    """
    found = storage.scan(os.fspath(directory))
    return storage.choose_latest([entry.path for entry in found])[0]


# --------------------------------------------------------------------------- helpers
_IN_PLACE = object()


def _owner(obj: Any) -> Any:
    """The strategy's ``extended`` whose variables ``obj`` holds, if one marked them.

    A strategy that keeps state away from the user's objects (the parameter servers) marks its
    tensors (:func:`phalanx.core.variable_sync.owner_of`), so that a Checkpoint made outside ``scope()`` still finds it.
    """
    if isinstance(obj, torch.Tensor):
        tensors: Any = [obj]
    elif keras_objects.is_keras_object(obj):
        tensors = keras_objects.tensors_of(obj)
    elif isinstance(obj, torch.nn.Module):
        tensors = obj.parameters()
    elif isinstance(obj, torch.optim.Optimizer):
        tensors = (p for group in obj.param_groups for p in group["params"])
    else:
        return None
    for t in tensors:
        owner = owner_of(t)
        if owner is not None:
            return owner
    return None


def _owning_strategy(owners: Any) -> Any:
    for extended in owners:
        strategy = extended.container_strategy if extended is not None else None
        if strategy is not None:
            return strategy
    return None


def _kind(obj: Any) -> str:
    if sharded_variables.is_sharded(obj):
        return "sharded"
    if isinstance(obj, torch.Tensor):
        return "tensor"
    if keras_objects.is_keras_object(obj):
        return f"keras:{type(obj).__module__}.{type(obj).__qualname__}"
    if hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict"):
        return f"state_dict:{type(obj).__module__}.{type(obj).__qualname__}"
    return "value"


def _state_of(obj: Any, objects: dict[str, Any]) -> Any:
    if sharded_variables.is_sharded(obj) or isinstance(obj, torch.Tensor):
        return obj
    if keras_objects.is_keras_object(obj):
        # By graph position, not by Keras' auto names; objects the Checkpoint names itself (an
        # optimizer also reachable as model.optimizer) are stored once, under their own name.
        return keras_objects.state_of(obj, skip={id(o) for o in objects.values() if o is not obj})
    if hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict"):
        return obj.state_dict()
    return obj


def _file_name(name: str, taken: dict[str, Any]) -> str:
    base = re.sub(r"[^A-Za-z0-9_.-]", "_", name).strip(".") or "object"
    candidate, n = f"{base}.pt", 1
    while candidate in taken or candidate == storage.MANIFEST:
        n += 1
        candidate = f"{base}_{n}.pt"
    return candidate


def _restore_into(name: str, live: Any, saved: Any) -> Any:
    """Puts ``saved`` into ``live`` in place; returns the replacement for immutable values."""
    if sharded_variables.is_sharded(live):
        if not isinstance(saved, torch.Tensor):
            raise CheckpointMismatchError(
                name, f"a sharded variable needs a tensor; the checkpoint holds {type(saved).__name__}"
            )
        sharded_variables.assign_full(live, saved)
        return _IN_PLACE
    if isinstance(live, torch.Tensor):
        _copy_tensor(name, live, saved)
        return _IN_PLACE
    if hasattr(live, "load_state_dict") and hasattr(live, "state_dict"):
        try:
            live.load_state_dict(saved)
        except (RuntimeError, KeyError, ValueError, TypeError, AttributeError) as e:
            raise CheckpointMismatchError(
                name,
                f"{type(live).__name__}.load_state_dict refused the saved state: {str(e).strip()[:500]}",
                hint="restore into an object built the same way as the one saved",
            ) from e
        return _IN_PLACE
    if isinstance(live, (dict, list)) and type(saved) is type(live):
        _assign_container(name, live, saved)
        return _IN_PLACE
    return saved


def _copy_tensor(name: str, live: torch.Tensor, saved: Any) -> None:
    if not isinstance(saved, torch.Tensor):
        raise CheckpointMismatchError(name, f"expected a tensor, the checkpoint holds {type(saved).__name__}")
    if live.shape != saved.shape:
        raise CheckpointMismatchError(name, f"shape {tuple(live.shape)} here, {tuple(saved.shape)} in the checkpoint")
    with torch.no_grad():
        live.copy_(saved)


def _assign_container(path: str, live: Any, saved: Any) -> None:
    keys = list(saved.keys()) if isinstance(saved, dict) else range(len(saved))
    if isinstance(live, list) and len(live) != len(saved):
        live[:] = saved
        return
    if isinstance(live, dict):
        for stale in [k for k in live if k not in saved]:
            del live[stale]
    for k in keys:
        current = live.get(k) if isinstance(live, dict) else live[k]
        if isinstance(current, torch.Tensor) and isinstance(saved[k], torch.Tensor) and current.shape == saved[k].shape:
            with torch.no_grad():
                current.copy_(saved[k])
        elif isinstance(current, (dict, list)) and type(saved[k]) is type(current):
            _assign_container(f"{path}/{k}", current, saved[k])
        else:
            live[k] = saved[k]
