"""``phalanx.function``: TF's ``@tf.function`` idiom for a distributed step, on ``torch.compile``.

TF programs wrap their distributed step in ``@tf.function``::

    @tf.function
    def distributed_train_step(dist_inputs):
        per_replica_losses = strategy.run(train_step, args=(dist_inputs,))
        return strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica_losses, axis=None)

With ``phalanx.function`` in place of ``tf.function`` the same code compiles what can be compiled:

* every replica function the decorated function passes to ``strategy.run`` is compiled with
  ``torch.compile`` (once per function, cached). Its forward pass and its optimizer update become
  compiled graphs; ``loss.backward()`` is a graph break, so backward runs through autograd and
  phalanx's gradient hooks start each bucket's all-reduce while backward goes on, exactly as in
  eager mode. The collectives themselves (``strategy.reduce``, ``all_reduce`` in replica
  context) stay eager: they are graph breaks too;
* a decorated function that calls no ``strategy.run`` is compiled as a whole.

What cannot be compiled runs eagerly: when ``torch.compile`` fails on a function (no C++
compiler, an unsupported construct, a backend error), phalanx warns once, naming the function
and the first line of the reason, and runs that function eagerly from then on. Nothing is run
twice: the fallback happens per frame inside ``torch.compile`` (its ``suppress_errors`` mode),
before the frame executes.

Every replica compiles its own copy of the same code, so every replica runs the same graph; the
results equal eager mode's to float tolerance (``tests/test_compiled.py`` checks 1e-5 against one
eager device).

Example:
    >>> import torch, phalanx as px
    >>> strategy = px.OneDeviceStrategy("cpu")
    >>> with strategy.scope():
    ...     model = torch.nn.Linear(4, 1)
    >>> @px.function(backend="eager")          # "inductor" (the default) generates C++ code
    ... def distributed_step(x):
    ...     per_replica = strategy.run(lambda t: model(t).sum(), args=(x,))
    ...     return strategy.reduce("SUM", per_replica, axis=None)
    >>> distributed_step(torch.ones(2, 4)).shape
    torch.Size([])
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import logging
import warnings
import weakref
from typing import Any, Callable, Iterator

import torch

from phalanx._compat.torch import COMPILE_FRAME_LOGGER, compile_falls_back_per_frame
from phalanx.errors import PhalanxError, user_stacklevel

_ACTIVE: contextvars.ContextVar["_Compiler | None"] = contextvars.ContextVar("phalanx_compiled", default=None)


class CompileFallbackWarning(UserWarning):
    """``phalanx.function`` could not compile a function and runs it eagerly."""


class CompileOptionsError(PhalanxError, ValueError):
    """Options of ``phalanx.function`` that ``torch.compile`` cannot take."""

    def __init__(self, options: dict[str, Any], reason: str) -> None:
        self.options = options
        super().__init__(
            f"phalanx.function received {options!r}: {reason}.",
            hint="see torch.compile's documentation for backend, mode and options",
        )


class _FallbackRecorder(logging.Filter):
    """Catches torch.compile's "WON'T CONVERT" records (a frame that falls back to eager)."""

    def __init__(self) -> None:
        super().__init__()
        self.reasons: list[str] = []

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if message.startswith("WON'T CONVERT"):
            error = record.exc_info[1] if record.exc_info else None
            while error is not None and (error.__cause__ or error.__context__) is not None:
                error = error.__cause__ or error.__context__  # the backend's own error, not dynamo's wrapper
            reason = f"{type(error).__name__}: {_first_line(str(error))}" if error is not None else message
            self.reasons.append(_first_line(reason))
            return False  # phalanx reports it once, in one line
        return True


def _first_line(text: str) -> str:
    for line in text.splitlines():
        if line.strip():
            return line.strip()[:300]
    return "unknown reason"


@contextlib.contextmanager
def _falling_back_per_frame(recorder: _FallbackRecorder) -> Iterator[None]:
    # suppress_errors makes torch.compile run a frame it cannot compile eagerly instead of raising,
    # before the frame runs: no work is done twice, unlike a retry after an exception would.
    logger = logging.getLogger(COMPILE_FRAME_LOGGER)
    logger.addFilter(recorder)
    try:
        with compile_falls_back_per_frame():
            yield
    finally:
        logger.removeFilter(recorder)


class _Compiler:
    """The compiled versions of one decorated function's replica functions."""

    def __init__(self, name: str, compile_kwargs: dict[str, Any]) -> None:
        self.name = name
        self.kwargs = compile_kwargs
        self.compiled: "weakref.WeakKeyDictionary[Any, Callable[..., Any]]" = weakref.WeakKeyDictionary()
        self.warned: set[str] = set()
        self.saw_replica_fn = False

    def replica_function(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        self.saw_replica_fn = True
        try:
            return self.compiled[fn]
        except (KeyError, TypeError):
            pass
        compiled = self.guarded(fn, torch.compile(fn, **self.kwargs))
        try:
            self.compiled[fn] = compiled
        except TypeError:  # not weak-referenceable: wrapped anew at each call; torch.compile's own
            pass  # cache (per code object) still reuses the compiled graphs
        return compiled

    def guarded(self, fn: Callable[..., Any], compiled: Callable[..., Any]) -> Callable[..., Any]:
        name = getattr(fn, "__qualname__", repr(fn))

        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            recorder = _FallbackRecorder()
            with _falling_back_per_frame(recorder):
                result = compiled(*args, **kwargs)
            if recorder.reasons and name not in self.warned:
                self.warned.add(name)
                warnings.warn(
                    f"phalanx.function could not compile {name} (inside {self.name}); it runs eagerly. "
                    f"Reason: {recorder.reasons[0]}",
                    CompileFallbackWarning,
                    stacklevel=user_stacklevel(),
                )
            return result

        return call


def replica_function(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` compiled if a :func:`function`-decorated caller is running, else ``fn`` itself.

    Called by ``Strategy.run`` for the function it is given.
    """
    compiler = _ACTIVE.get()
    return fn if compiler is None else compiler.replica_function(fn)


def function(
    func: Callable[..., Any] | None = None,
    *,
    backend: str | Callable[..., Any] = "inductor",
    mode: str | None = None,
    fullgraph: bool = False,
    dynamic: bool | None = None,
    options: dict[str, Any] | None = None,
    reduce_retracing: bool = False,
    jit_compile: bool | None = None,
    input_signature: Any = None,
    autograph: bool = True,
) -> Any:
    """Compiles a distributed step as ``tf.function`` does; usable as ``@function`` or ``@function(...)``.

    Args:
        func: the function to decorate.
        backend, mode, fullgraph, dynamic, options: passed to ``torch.compile``.
        reduce_retracing: TF's name for dynamic shapes (``dynamic=True``).
        jit_compile: TF's XLA switch; ``False`` runs eagerly (nothing is compiled).
        input_signature, autograph: accepted for TF signature parity; torch.compile specialises
            on the shapes it sees and traces Python control flow itself.

    Returns:
        The decorated function. It runs eagerly itself; the replica functions it passes to
        ``strategy.run`` run compiled (or, with no ``strategy.run`` inside, the whole function).

    Raises:
        CompileOptionsError: ``mode`` and ``options`` were both given.
    """
    if mode is not None and options is not None:
        raise CompileOptionsError({"mode": mode, "options": options}, "torch.compile takes either mode or options")
    kwargs: dict[str, Any] = {
        "backend": backend,
        "fullgraph": fullgraph,
        "dynamic": True if reduce_retracing else dynamic,
    }
    if mode is not None:
        kwargs["mode"] = mode
    if options is not None:
        kwargs["options"] = options

    def decorate(f: Callable[..., Any]) -> Callable[..., Any]:
        if jit_compile is False:
            return f
        compiler = _Compiler(getattr(f, "__qualname__", repr(f)), kwargs)
        whole: list[Callable[..., Any]] = []

        @functools.wraps(f)
        def wrapper(*args: Any, **kw: Any) -> Any:
            if whole:
                return whole[0](*args, **kw)
            token = _ACTIVE.set(compiler)
            try:
                result = f(*args, **kw)
            finally:
                _ACTIVE.reset(token)
            if not compiler.saw_replica_fn:
                # No strategy.run inside: compile the function itself from the next call on.
                whole.append(compiler.guarded(f, torch.compile(f, **kwargs)))
            return result

        wrapper.python_function = f  # type: ignore[attr-defined]  # TF's attribute for the undecorated function
        return wrapper

    return decorate(func) if func is not None else decorate
