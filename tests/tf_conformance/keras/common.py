"""What the Keras cases share: the reference run without a strategy, inputs, files and comparisons.

TF's Keras tests compare a model trained under a strategy with the same model trained without one
(``MaybeDistributionScope(None)``). Here every process of the job computes that reference itself,
outside any scope, from the same seeded data and initial weights, so each replica compares its own
results with one device's. TF's ``tf.data.Dataset.from_tensor_slices(...).batch(b)`` is a torch
``DataLoader`` of global batches; TF's ``repeat(epochs)`` with ``steps_per_epoch`` is the loader
iterated once per epoch.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any, Iterator

import keras
import numpy as np
import torch

import phalanx as px

RANDOM_SEED = 1337  # TF's _RANDOM_SEED


@contextlib.contextmanager
def maybe_scope(strategy: Any) -> Iterator[None]:
    """TF's ``MaybeDistributionScope``: the strategy's scope, or none (plain Keras on one device)."""
    if strategy is None:
        yield
    else:
        with strategy.scope():
            yield


def seed(value: int = RANDOM_SEED) -> None:
    """TF's ``np.random.seed`` and ``tf.compat.v1.set_random_seed``: the same draws on every process."""
    np.random.seed(value)
    keras.utils.set_random_seed(value)


def loader(*arrays: Any, batch_size: int, shuffle: bool = False, drop_last: bool = False) -> Any:
    """``Dataset.from_tensor_slices(arrays).batch(batch_size)`` as a DataLoader of global batches.

    A dict of arrays (named inputs) yields dicts; several arrays yield tuples.
    """

    class _Rows(torch.utils.data.Dataset):
        def __init__(self, parts: tuple) -> None:
            self.parts = parts
            first = parts[0]
            self.n = len(next(iter(first.values()))) if isinstance(first, dict) else len(first)

        def __len__(self) -> int:
            return self.n

        def __getitem__(self, i: int) -> Any:
            row = tuple({k: v[i] for k, v in p.items()} if isinstance(p, dict) else p[i] for p in self.parts)
            return row[0] if len(row) == 1 else row

    def collate(rows: list) -> Any:
        def stack(items: list) -> Any:
            if isinstance(items[0], dict):
                return {k: stack([it[k] for it in items]) for k in items[0]}
            return torch.as_tensor(np.stack(items))

        if isinstance(rows[0], tuple):
            return tuple(stack([r[i] for r in rows]) for i in range(len(rows[0])))
        return stack(rows)

    return torch.utils.data.DataLoader(
        _Rows(arrays), batch_size=batch_size, shuffle=shuffle, drop_last=drop_last, collate_fn=collate
    )


def shared_dir(name: str) -> Path:
    """A folder every process of the job sees (the job's working directory), for one case's files.

    Every replica runs this line, so the folder is made with ``exist_ok`` (the porting guide's idiom).
    """
    path = Path.cwd() / "keras_files" / name
    path.mkdir(parents=True, exist_ok=True)
    return path


def to_numpy(value: Any) -> Any:
    """Results (tensors, lists, dicts of them, History dicts) as numpy arrays / floats, nested."""
    if isinstance(value, dict):
        return {k: to_numpy(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_numpy(v) for v in value]
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().numpy()
    if hasattr(value, "numpy") and not isinstance(value, np.ndarray):
        return np.asarray(value.numpy())
    return np.asarray(value) if isinstance(value, (np.ndarray, np.generic)) else value


def all_close(got: Any, expected: Any, atol: float, rtol: float, what: str = "", equal_nan: bool = False) -> None:
    """TF's ``assertAllClose(got, expected, atol, rtol)`` over nested results: ``|g - e| <= atol + rtol |e|``
    (NaN equals NaN where TF's own computation gives NaN: ``equal_nan``)."""
    g, e = to_numpy(got), to_numpy(expected)
    if isinstance(e, dict):
        assert isinstance(g, dict) and sorted(g) == sorted(e), f"{what}: keys {sorted(g)} != {sorted(e)}"
        for k in e:
            all_close(g[k], e[k], atol, rtol, f"{what}[{k!r}]", equal_nan)
        return
    if isinstance(e, list) and not _numeric_list(e):
        assert isinstance(g, list) and len(g) == len(e), f"{what}: {len(g)} items != {len(e)}"
        for i, (a, b) in enumerate(zip(g, e)):
            all_close(a, b, atol, rtol, f"{what}[{i}]", equal_nan)
        return
    a, b = np.asarray(g, dtype=np.float64), np.asarray(e, dtype=np.float64)
    assert a.shape == b.shape, f"{what}: shape {a.shape} != {b.shape}"
    if equal_nan:
        assert np.array_equal(np.isnan(a), np.isnan(b)), f"{what}: NaN at different places: {a} vs {b}"
        a, b = np.nan_to_num(a, nan=0.0), np.nan_to_num(b, nan=0.0)
    worst = float(np.max(np.abs(a - b) - (atol + rtol * np.abs(b)))) if a.size else -1.0
    assert worst <= 0.0, f"{what}: differs by {float(np.max(np.abs(a - b))):.3g} (atol {atol}, rtol {rtol})"


def _numeric_list(items: list) -> bool:
    return all(isinstance(x, (int, float, np.number)) for x in items)


def replicas_agree(strategy: Any, values: Any, what: str = "") -> None:
    """Every replica holds the same ``values`` (weights, results): a collective, call it on every replica."""
    if strategy.num_replicas_in_sync == 1:
        return
    flat = [np.asarray(v, dtype=np.float64).ravel() for v in _leaves(to_numpy(values))]
    mine = torch.as_tensor(np.concatenate(flat) if flat else np.zeros(0))
    chief = mine.clone()
    strategy.extended.broadcast([chief])
    diff = float((mine - chief).abs().max()) if mine.numel() else 0.0
    assert diff == 0.0, f"{what}: replica {strategy.extended.process_index} differs from the chief by {diff:.3g}"


def _leaves(value: Any) -> list:
    if isinstance(value, dict):
        return [x for k in sorted(value) for x in _leaves(value[k])]
    if isinstance(value, (list, tuple)):
        return [x for v in value for x in _leaves(v)]
    return [value]


def replica_id() -> int:
    """This replica's id in the synchronous group (inside ``run``)."""
    return int(px.get_replica_context().replica_id_in_sync_group)


def environ_flag(name: str) -> bool:
    return os.environ.get(name, "") not in ("", "0")
