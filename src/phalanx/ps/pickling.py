"""Shipping functions from the coordinator to workers (cloudpickle), with shared objects by reference.

A scheduled function is pickled with cloudpickle (functions of ``__main__`` and lambdas by value).
Objects that each worker holds itself are replaced by *persistent ids* instead of being copied:
the variables created in the strategy's scope (a worker keeps its own copy of each and refreshes
it from the parameter servers), the strategy, and per-worker datasets and iterators. Modules and
optimizers are copied by value: small, because their parameters are references.

Unpickling runs code by design, so it only ever happens to a blob whose frame carried the
cluster secret's signature (:func:`phalanx.ps.wire.decode` checks it first); parameter servers
never unpickle anything.
"""

from __future__ import annotations

import importlib
import io
import pickle
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

#: The first element of a registered reference: ``(EXTENSION, module, kind, payload)``.
EXTENSION = "ext"


@dataclass(frozen=True)
class Reference:
    """How objects of one type travel by reference (see :func:`register_reference`)."""

    kind: str
    type: type
    to_ref: Callable[[Any, Any], Any]
    from_ref: Callable[[Any, Any, Any], Any]
    module: str


_REFERENCES: dict[str, Reference] = {}
_TYPES: tuple[type, ...] = ()
_LOCK = threading.Lock()


def register_reference(
    kind: str, type_: type, to_ref: Callable[[Any, Any], Any], from_ref: Callable[[Any, Any, Any], Any]
) -> None:
    """Lets objects of ``type_`` in a scheduled function travel as a reference the worker resolves.

    The extension point through which layers above the parameter-server machinery (Keras) ship
    their objects, so the machinery itself knows none of them.

    Args:
        kind: a unique name for the reference.
        type_: the objects concerned (``isinstance``).
        to_ref: on the coordinator, ``to_ref(obj, extended)``: a picklable payload for ``obj``,
            or None to pickle it by value.
        from_ref: on the worker, ``from_ref(worker, payload, run)``: the local object; ``worker``
            is the :class:`~phalanx.ps.worker.WorkerService`, ``run`` its current scheduled run
            (None while building resources).

    The registering module's name travels with the reference, so a worker that has not imported
    it yet (its script imports the integration after the strategy line) imports it to resolve it.
    """
    global _TYPES
    with _LOCK:
        _REFERENCES[kind] = Reference(kind, type_, to_ref, from_ref, to_ref.__module__)
        _TYPES = tuple({r.type for r in _REFERENCES.values()})


def registered_kinds() -> tuple[str, ...]:
    """The kinds of reference registered in this process."""
    return tuple(_REFERENCES)


def reference_to(obj: Any, extended: Any) -> tuple | None:
    """The registered reference for ``obj`` (``(EXTENSION, module, kind, payload)``), or None."""
    if not _TYPES or not isinstance(obj, _TYPES):
        return None
    for ref in list(_REFERENCES.values()):
        if isinstance(obj, ref.type):
            payload = ref.to_ref(obj, extended)
            if payload is not None:
                return (EXTENSION, ref.module, ref.kind, payload)
    return None


def resolve_reference(pid: tuple, worker: Any, run: Any) -> Any:
    """The worker's object for a reference made by :func:`reference_to`.

    Raises:
        pickle.UnpicklingError: no registration for the reference's kind, even after importing
            the module that made it.
    """
    _, module, kind, payload = pid
    ref = _REFERENCES.get(kind)
    if ref is None:
        importlib.import_module(module)  # the signed function named it: the module registers the kind
        ref = _REFERENCES.get(kind)
    if ref is None:
        raise pickle.UnpicklingError(f"no reference of kind {kind!r} is registered (module {module!r})")
    return ref.from_ref(worker, payload, run)


def dumps(obj: Any, persistent_id: Callable[[Any], Any] | None = None) -> bytes:
    """cloudpickle ``obj``; ``persistent_id(o)`` may return a reference to use instead of ``o``."""
    try:
        import cloudpickle
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("ParameterServerStrategy ships functions with cloudpickle: pip install -e '.[ps]'") from e

    class _Pickler(cloudpickle.Pickler):
        def persistent_id(self, o: Any) -> Any:
            return persistent_id(o) if persistent_id is not None else None

    buf = io.BytesIO()
    _Pickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return buf.getvalue()


def loads(data: bytes, persistent_load: Callable[[Any], Any] | None = None) -> Any:
    """Unpickles verified ``data``; ``persistent_load(ref)`` resolves references to local objects."""

    class _Unpickler(pickle.Unpickler):
        def persistent_load(self, pid: Any) -> Any:
            if persistent_load is None:
                raise pickle.UnpicklingError(f"unexpected reference {pid!r}")
            return persistent_load(pid)

    return _Unpickler(io.BytesIO(data)).load()
