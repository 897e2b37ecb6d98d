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

import io
import pickle
from collections.abc import Callable
from typing import Any


def dumps(obj: Any, persistent_id: Callable[[Any], Any] | None = None) -> bytes:
    """cloudpickle ``obj``; ``persistent_id(o)`` may return a reference to use instead of ``o``."""
    try:
        import cloudpickle
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("ParameterServerStrategy ships functions with cloudpickle: pip install 'phalanx[ps]'") from e

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
