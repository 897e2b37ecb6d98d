"""Typed errors of parameter-server training.

They follow TF's contract: a dead worker is never an error (its functions run again elsewhere);
a dead parameter server is (:class:`ParameterServerUnavailableError`, raised by ``schedule``,
``join``, ``done`` and ``fetch``); functions that were still queued when another one failed are
cancelled (:class:`CancelledError` from their ``fetch``).

Example:
    >>> from phalanx.ps.errors import ParameterServerUnavailableError
    >>> e = ParameterServerUnavailableError(1, "127.0.0.1:2222", "connection refused")
    >>> e.task, e.index
    ('/job:ps/replica:0/task:1', 1)
"""

from __future__ import annotations

from phalanx.errors import DistributedRuntimeError, PhalanxError


def task_device(job: str, index: int) -> str:
    """TF's name of a task, e.g. ``/job:ps/replica:0/task:1``."""
    return f"/job:{job}/replica:0/task:{index}"


class TaskUnavailableError(DistributedRuntimeError):
    """A task of the cluster (parameter server or worker) does not answer.

    Attributes:
        job, index, address: which task, and where it was expected.
        cause: what the transport reported.
    """

    job = "worker"

    def __init__(self, index: int, address: str, cause: str, *, hint: str | None = None) -> None:
        self.index = index
        self.address = address
        self.cause = cause
        self.task = task_device(self.job, index)
        super().__init__(f"{self.task} ({self.job}:{index} at {address}) is unavailable: {cause}.", hint=hint)


class ParameterServerUnavailableError(TaskUnavailableError):
    """A parameter server died, stalled, restarted (losing its variables) or cannot be reached."""

    job = "ps"

    def __init__(self, index: int, address: str, cause: str) -> None:
        super().__init__(
            index,
            address,
            cause,
            hint=(
                "the variables on a parameter server are lost with it: restart the parameter server and the "
                "coordinator (chief) and restore the variables from the last checkpoint"
            ),
        )


class WorkerUnavailableError(TaskUnavailableError):
    """No worker could run scheduled functions for longer than the recovery timeout."""


class CancelledError(PhalanxError, RuntimeError):
    """A scheduled function was cancelled, because an earlier one failed or the coordinator shut down."""


class RemoteError(PhalanxError, RuntimeError):
    """A scheduled function raised an exception that could not be sent back as itself.

    Attributes:
        type_name: the remote exception's type.
        remote_traceback: its traceback, as text.
    """

    def __init__(self, task: str, type_name: str, message: str, remote_traceback: str) -> None:
        self.type_name = type_name
        self.remote_traceback = remote_traceback
        super().__init__(f"{type_name} on {task}: {message}\nRemote traceback:\n{remote_traceback}")


class ClusterSecretError(PhalanxError, ValueError):
    """No usable cluster secret: code is only shipped between tasks that prove they share one."""

    def __init__(self, value_description: str, problem: str) -> None:
        self.value_description = value_description
        super().__init__(
            f"PHALANX_CLUSTER_SECRET={value_description}: {problem}.",
            hint="set the same random PHALANX_CLUSTER_SECRET (at least 16 characters) in every task, e.g. "
            "`export PHALANX_CLUSTER_SECRET=$(python -c 'import secrets; print(secrets.token_hex(32))')`; "
            "`phalanx run --ps N --workers M` generates one for its cluster",
        )


class AuthenticationError(PhalanxError, PermissionError):
    """A message did not carry a valid signature of the cluster secret; it was not deserialized."""


class OverloadedError(PhalanxError, RuntimeError):
    """A server refused a request at once because too many unverified requests were in flight
    (a flood, or a burst beyond the bound); callers retry it as a transient failure."""


class OrphanedError(PhalanxError, RuntimeError):
    """A parameter server or worker heard nothing authenticated from the chief for
    ``PHALANX_ORPHAN_TIMEOUT`` seconds (counted from its start) and exits."""

    def __init__(self, task: str, timeout: float, ever_seen: bool) -> None:
        self.task_name, self.timeout = task, timeout
        what = (
            "since the chief's last authenticated request"
            if ever_seen
            else "since it started, and the chief never sent an authenticated request"
        )
        super().__init__(
            f"{task}: no word from the chief for {timeout:g}s (PHALANX_ORPHAN_TIMEOUT) {what}; exiting.",
            hint="the chief died, or it does not hold this cluster's PHALANX_CLUSTER_SECRET (its log "
            "says 'refused'); restart the job, with the same secret in every task",
        )


class ProtocolError(PhalanxError, ValueError):
    """A message that is signed but malformed (wrong framing, dtype, shape or size)."""


class VariableError(PhalanxError, ValueError):
    """A variable request a parameter server refused: unknown name, or a shape or dtype that differs."""


class CoordinatorClosedError(PhalanxError, RuntimeError):
    """The coordinator was shut down; it schedules nothing more."""
