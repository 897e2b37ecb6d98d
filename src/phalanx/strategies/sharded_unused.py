"""Unused parameters under FullyShardedStrategy: ``.grad`` left as one device leaves it.

FSDP2 reduce-scatters a zero gradient for a parameter this replica did not use (so that every
replica's collectives keep one layout; ``set_reduce_scatter_unused_params``, torch >= 2.9), and so
a parameter that *no* replica used gets a zero ``.grad`` where one device leaves None: momentum
and weight decay would then move it. As DDP's ``find_unused_parameters`` does, each replica notes
the parameters its passes reached (a hook on the gathered parameters autograd accumulates into),
and one small all-reduce of those flags at the end of a synchronising backward tells which no
replica used; those that had no gradient before the pass get None back. A parameter that held an
accumulated gradient keeps it (FSDP2 added zeros to it).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.utils.weak import WeakIdKeyDictionary

from phalanx._compat.torch import fsdp_parameters, queue_backward_callback, untraced
from phalanx.comm.flight_recorder import recording


class UnusedParameters:
    """Gives ``None`` back to the sharded parameters no replica used in a synchronising backward.

    Args:
        comm: the communicator among the replicas (the flags' all-reduce).
        fsdp_module: FSDP2's ``FSDPModule`` class (what ``fully_shard`` makes a module).

    Attributes:
        syncing: False while backward passes accumulate without reducing (``no_sync``): the flags
            of those passes are kept for the pass that reduces.
    """

    def __init__(self, comm: Any, fsdp_module: type) -> None:
        self._comm = comm
        self._fsdp_module = fsdp_module
        self._roots: list[weakref.ref[torch.nn.Module]] = []  # in the order every replica sharded them
        self._watched: WeakIdKeyDictionary = WeakIdKeyDictionary()  # gathered -> ref to its sharded one
        self._complete: "weakref.WeakSet[torch.nn.Module]" = weakref.WeakSet()  # roots fully watched
        self._used: set[int] = set()  # ids of sharded parameters this replica's passes reached
        self._none_before: list[bool] | None = None  # per sharded parameter: .grad None before backward
        self._backward_queued = False
        self.syncing = True

    def watch(self, root: torch.nn.Module) -> None:
        """Watches a root module just sharded (call after ``fully_shard``: this forward hook must run
        after FSDP2's, so that the hook it puts on the outputs runs after FSDP2's and its
        end-of-backward callback comes after FSDP2's, which sets the sharded gradients)."""
        self._roots.append(weakref.ref(root))
        ref = weakref.WeakMethod(self._after_forward)

        def hook(module: torch.nn.Module, args: Any, output: Any) -> None:
            bound = ref()
            if bound is not None:
                bound(module, output)

        root.register_forward_hook(untraced(hook))

    def _sharded_parameters(self) -> list[torch.Tensor]:
        """Every sharded parameter, in the same order on every replica."""
        out = []
        for ref in self._roots:
            root = ref()
            if root is None:
                continue
            for m in root.modules():
                if isinstance(m, self._fsdp_module):
                    out.extend(sharded for sharded, _ in fsdp_parameters(m))
        return out

    def _after_forward(self, module: torch.nn.Module, output: Any) -> None:
        if not torch.is_grad_enabled():
            return
        if module not in self._complete:
            # FSDP2 makes each gathered parameter at its group's first all-gather and keeps it:
            # watched once, the module's forwards cost nothing more here.
            complete = True
            note = weakref.WeakMethod(self._note_use)
            for m in module.modules():
                if not isinstance(m, self._fsdp_module):
                    continue
                for sharded, gathered in fsdp_parameters(m):
                    if gathered is None:
                        complete = False
                    elif gathered not in self._watched:
                        self._watched[gathered] = weakref.ref(sharded)
                        gathered.register_post_accumulate_grad_hook(_call_weak(note))
            if complete:
                self._complete.add(module)
        at_backward = _call_weak(weakref.WeakMethod(self._at_backward))
        for t in _grad_tensors(output):
            t.register_hook(at_backward)

    def _note_use(self, gathered: torch.Tensor) -> None:
        ref = self._watched.get(gathered)
        sharded = ref() if ref is not None else None
        if sharded is not None:
            self._used.add(id(sharded))

    def _at_backward(self, grad: torch.Tensor) -> None:
        if self._backward_queued:
            return
        self._backward_queued = True
        if self._none_before is None:  # the first pass since the last synchronisation
            self._none_before = [p.grad is None for p in self._sharded_parameters()]
        queue_backward_callback(self._after_backward)

    def _after_backward(self) -> None:
        self._backward_queued = False
        if not self.syncing:
            return  # under no_sync: the books run on to the pass that reduces
        params = self._sharded_parameters()
        none_before, used = self._none_before, self._used
        self._none_before, self._used = None, set()
        if none_before is None or len(none_before) != len(params):
            return
        flags = torch.tensor([1.0 if id(p) in used else 0.0 for p in params], dtype=torch.float32)
        with recording(self._comm, "unused"):
            summed = self._comm.all_reduce(flags, "sum").wait()
        for p, count, was_none in zip(params, summed.tolist(), none_before):
            if count == 0 and was_none:
                p.grad = None


def _call_weak(ref: weakref.WeakMethod) -> Any:
    """A one-argument hook (a tensor's) that calls ``ref``'s method while its object lives and
    returns None (the gradient unchanged): the tensors outlive the strategy."""

    def hook(arg: Any) -> None:
        bound = ref()
        if bound is not None:
            bound(arg)

    return hook


def _grad_tensors(output: Any) -> list[torch.Tensor]:
    """The tensors in a forward's output (nested tuples, lists, dicts) that backward will reach."""
    if isinstance(output, torch.Tensor):
        return [output] if output.requires_grad else []
    if isinstance(output, (tuple, list)):
        return [t for item in output for t in _grad_tensors(item)]
    if isinstance(output, dict):
        return [t for item in output.values() for t in _grad_tensors(item)]
    return []
