"""torch's private APIs phalanx relies on, each behind one function.

Checked on torch 2.4 to 2.15 (CI runs 2.13.0 CPU; ``tests/test_compat.py`` exercises every shim,
so a torch that changed one fails there first, with the shim's name).
"""

from __future__ import annotations

import datetime
import functools
import sys
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.utils import _pytree as pytree  # noqa: F401 - re-exported: phalanx.nest walks structures with it

__all__ = [
    "COMPILE_FRAME_LOGGER",
    "accumulation_node",
    "compile_falls_back_per_frame",
    "current_graph_task_id",
    "default_group_store",
    "default_store_address",
    "gloo_options",
    "nccl_options",
    "pytree",
    "queue_backward_callback",
    "tracing",
    "untraced",
    "will_accumulate",
    "version_counter",
]


# The logger torch.compile reports a frame it could not compile on (``torch._dynamo.convert_frame``,
# torch 2.1 to 2.15); phalanx.core.compiled listens to it to name the frame that ran eagerly.
COMPILE_FRAME_LOGGER = "torch._dynamo.convert_frame"


def version_counter(tensor: torch.Tensor) -> int:
    """The tensor's in-place modification counter (``Tensor._version``; torch >= 1.0, unchanged to 2.15).

    It grows whenever the tensor's data is changed in place (``add_``, ``copy_``, an optimizer
    step), which is how phalanx notices writes without copying the tensor.
    """
    return tensor._version


def queue_backward_callback(callback: Callable[[], None]) -> None:
    """Runs ``callback`` once the current backward pass has finished (torch >= 1.0 to 2.15).

    ``Variable._execution_engine.queue_callback``: the hook DDP, DeepSpeed and FSDP use to act
    once every gradient of a backward pass is ready. Must be called during a backward pass.
    """
    # A compiled step's backward runs with torch.compile's frame hook set: the callback
    # (collectives, waits) must run as plain Python, never be traced into graphs.
    torch.autograd.Variable._execution_engine.queue_callback(untraced(callback))


# The autograd run (graph task) the calling hook runs in; -1 outside backward. The C function
# itself (torch >= 1.10 to 2.15), not a wrapper: a gradient hook calls it once per parameter.
current_graph_task_id: Callable[[], int] = torch._C._current_graph_task_id


def accumulation_node(param: torch.Tensor) -> Any:
    """``param``'s AccumulateGrad node (torch >= 1.0 to 2.15: the next function of a view's grad_fn).

    Holding it keeps it alive, and so the same node, for the parameter's life (DDP does the same).
    """
    with torch.enable_grad():  # also from a backward callback, which runs without grad mode
        return param.view_as(param).grad_fn.next_functions[0][0]


def will_accumulate(node: Any) -> bool:
    """Whether the running backward will accumulate into the ``.grad`` of ``node``'s parameter.

    ``torch._C._will_engine_execute_node`` (torch >= 1.13 to 2.15) answers for ``backward()`` and
    ``backward(inputs=...)``; inside ``torch.autograd.grad`` torch refuses to answer for a leaf
    (a RuntimeError), and nothing is accumulated there. Call it from a hook, during backward.
    """
    try:
        return bool(torch._C._will_engine_execute_node(node))
    except RuntimeError:
        return False


def fsdp_parameters(module: torch.nn.Module) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """(sharded parameter, gathered parameter) for each parameter of ``module``'s own FSDP2 group.

    The gathered one is the ``nn.Parameter`` FSDP2 swaps in for forward and backward (created at the
    group's first all-gather and kept; None before it): autograd accumulates into it. Private
    (``FSDPState._fsdp_param_groups``, a list in recent torch, one ``_fsdp_param_group`` before;
    ``FSDPParam.sharded_param`` and ``_unsharded_param``, torch 2.4 to 2.15).
    """
    state = module._get_fsdp_state()  # type: ignore[operator]
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:
        group = getattr(state, "_fsdp_param_group", None)
        groups = [group] if group is not None else []
    return [(fp.sharded_param, getattr(fp, "_unsharded_param", None)) for g in groups for fp in g.fsdp_params]


def tracing() -> bool:
    """Whether torch.compile is tracing the calling code (False, cheaply, until ``torch._dynamo`` is loaded)."""
    return "torch._dynamo" in sys.modules and torch.compiler.is_compiling()


def untraced(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn``, never traced by torch.compile (``torch.compiler.disable``, torch 2.1 to 2.15).

    ``torch.compiler.disable`` imports torch.compile's machinery, 3 to 5 s per process here, and sets
    ``TORCHINDUCTOR_CACHE_DIR`` in the environment: the wrapper takes it only once
    ``torch._dynamo`` has been imported by someone, i.e. once something may be compiled.
    """

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        # Run as it is unless torch.compile is tracing this very call (dynamo reads is_compiling()
        # as True while tracing): the disabled wrapper swaps dynamo's frame callback on every call,
        # 10-30 us each, and a gradient hook runs once per parameter per step (measured: a third
        # of a small model's step on one GPU with the gradient all-reduce on).
        if "torch._dynamo" not in sys.modules or not torch.compiler.is_compiling():
            return fn(*args, **kwargs)
        # Made here each time, never stored: dynamo replays a closure's mutation only after the
        # traced code, so a wrapper stored while tracing was still None when called (TypeError).
        return torch.compiler.disable(fn)(*args, **kwargs)

    return call


def gloo_options(timeout: datetime.timedelta, bind_addr: str) -> Any:
    """Options of a gloo process group: its timeout and the device bound to ``bind_addr``.

    ``ProcessGroupGloo._Options`` with ``_timeout`` and ``_devices`` (torch 2.4 to 2.15): the only
    way to build a gloo group whose sockets listen on the task's own address, never 0.0.0.0.
    """
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = timeout
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=bind_addr)]
    return opts


def nccl_options(timeout: datetime.timedelta) -> Any:
    """Options of an NCCL process group with ``timeout`` (``Options._timeout``, torch 2.4 to 2.15)."""
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = timeout
    return opts


def compile_falls_back_per_frame() -> Any:
    """A context manager in which torch.compile runs a frame it cannot compile eagerly, not raising.

    ``torch._dynamo.config.patch(suppress_errors=True)`` (torch 2.0 to 2.15): the fallback happens
    before the frame runs, so no work is done twice. torch logs each such frame as "WON'T CONVERT"
    on the ``torch._dynamo.convert_frame`` logger (at WARNING), which phalanx.function reads.
    """
    return torch._dynamo.config.patch(suppress_errors=True)


def default_group_store() -> Any | None:
    """The store torch's default process group was made from, its ``default_pg`` prefix removed
    (``distributed_c10d._get_default_store``, torch 1.x to 2.15); None without a default group.

    What an engine's rendezvous left (Ray Train, a program's ``init_process_group``): phalanx joins
    it rather than listening on the port it already holds.
    """
    if not dist.is_initialized():
        return None
    from torch.distributed import distributed_c10d

    store = distributed_c10d._get_default_store()
    while isinstance(store, dist.PrefixStore):  # init_process_group wraps its store in PrefixStore("default_pg")
        store = store.underlying_store
    return store


def default_store_address() -> tuple[str, int] | None:
    """``(host, port)`` of the TCP store behind torch's default group, or None (no group, no TCP store)."""
    store = default_group_store()
    if not isinstance(store, dist.TCPStore):
        return None
    return str(store.host), int(store.port)
