"""Sparse gradients summed across replicas, as TF sums ``IndexedSlices`` (``nn.Embedding(sparse=True)``).

:class:`~phalanx.comm.reducer.GradientReducer` flags a parameter that got a sparse gradient in
its bucket (its dense place adds zeros) and, once the flags are summed, hands every parameter some
replica gave a sparse gradient to :func:`sum_sparse`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from phalanx.errors import SparseGradientError

__all__ = ["sum_sparse"]


def sum_sparse(
    items: list[tuple[torch.nn.Parameter, torch.Tensor | None]],
    all_gather: Callable[[torch.Tensor], list[torch.Tensor]] | None,
    name_of: Callable[[torch.Tensor], str],
) -> None:
    """Sums the sparse gradients of ``items`` across the replicas, as TF sums ``IndexedSlices``:
    every replica's indices and values are gathered (none from a replica that did not use the
    parameter) and the result is one coalesced sparse gradient, added to what ``.grad`` held.

    Every replica reaches this with the same parameters in the same order (the summed flags
    say which). One all-gather of the counts for them all, then two per parameter.

    Raises:
        SparseGradientError: this strategy's reduction cannot gather (CentralStorage's).
    """
    if all_gather is None:
        raise SparseGradientError(
            name_of(items[0][0]),
            "this strategy (its gradients reach one replica)",
            hint="use MirroredStrategy or MultiWorkerMirroredStrategy, or a dense embedding (sparse=False)",
        )
    local = []
    for p, _ in items:
        g = p.grad if p.grad is not None and p.grad.layout != torch.strided else None
        local.append(g.coalesce() if g is not None else None)
    device = items[0][0].device
    counts = torch.tensor([_nnz(g) for g in local], dtype=torch.int64, device=device)
    every = [c.tolist() for c in all_gather(counts)]
    for i, ((p, prior), g) in enumerate(zip(items, local)):
        nnz = [row[i] for row in every]
        most = max(nnz)
        dense_shape = tuple(p.shape)
        if most == 0:
            p.grad = prior
            continue
        sparse_dims = g.sparse_dim() if g is not None else 1
        indices = torch.zeros(sparse_dims, most, dtype=torch.int64, device=device)
        values = torch.zeros((most, *dense_shape[sparse_dims:]), dtype=p.dtype, device=device)
        if g is not None:
            indices[:, : _nnz(g)] = g.indices()
            values[: _nnz(g)] = g.values()
        all_indices = all_gather(indices)
        all_values = all_gather(values)
        summed = torch.sparse_coo_tensor(
            torch.cat([ix[:, :n] for ix, n in zip(all_indices, nnz)], dim=1),
            torch.cat([v[:n] for v, n in zip(all_values, nnz)]),
            dense_shape,
        ).coalesce()
        p.grad = summed if prior is None else prior + summed


def _nnz(g: torch.Tensor | None) -> int:
    """The rows a coalesced sparse gradient holds (0 for none)."""
    return 0 if g is None else int(g.indices().shape[1])
