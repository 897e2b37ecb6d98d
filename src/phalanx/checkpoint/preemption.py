"""Saving at an agreed step when a worker is told to stop (``tf.distribute.experimental.PreemptionCheckpointHandler``).

Platforms announce preemption with SIGTERM (Kubernetes, Slurm, spot VMs). The signal reaches one
process, and the others must stop at the *same* step, or they would deadlock in the next
collective or save inconsistent state. So every :meth:`PreemptionCheckpointHandler.run` ends
with one tiny all-reduce: "has anyone been told to stop?". When the answer is yes, every process
saves the checkpoint at that step (through the manager: the chief writes, all wait for it) and
exits with :data:`~phalanx.launch.runner.RESTART_EXIT_CODE` (42). ``phalanx run --max-restarts K``
then starts the job again; the new handler restores the checkpoint, ``total_run_calls`` included,
and the loop continues from that step.

Only terminations with notice are handled; a process that is killed outright (SIGKILL, power
loss) is recovered from the last regular ``CheckpointManager.save``.

Under Slurm the notice is also SIGUSR1, the signal a job asks for before its time limit
(``sbatch --signal=USR1@120``: Slurm sends it to every task of the job's steps 120 s before the
end), unless the program handles SIGUSR1 itself or chose it for stack dumps
(``PHALANX_STACK_SIGNAL``). The batch script requeues the job when the step exits with 42
(``docs/deploy/slurm-requeue.sbatch``), and the requeued job (``SLURM_RESTART_COUNT`` > 0) must
find the checkpoint: a requeued job that finds none is a :class:`CheckpointNotFoundError` (the
directory is not on storage every node shares, or was removed), not a silent start from step 0.

Example (``train.py``, run with ``phalanx run -n 2 --max-restarts 3 train.py``)::

    strategy = phalanx.MultiWorkerMirroredStrategy()
    with strategy.scope():
        model, optimizer = make_model(), make_optimizer()
        ckpt = phalanx.checkpoint.Checkpoint(model=model, optimizer=optimizer)
    manager = phalanx.checkpoint.CheckpointManager(ckpt, "/shared/ckpts", max_to_keep=2)
    handler = phalanx.checkpoint.PreemptionCheckpointHandler(strategy.cluster_resolver, manager)
    for epoch in range(handler.total_run_calls // STEPS_PER_EPOCH, EPOCHS):
        for step in range(handler.total_run_calls % STEPS_PER_EPOCH, STEPS_PER_EPOCH):
            handler.run(train_step, epoch, step)    # train_step calls strategy.run
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from phalanx.checkpoint.checkpoint import Checkpoint
from phalanx.checkpoint.errors import CheckpointNotFoundError
from phalanx.checkpoint.manager import CheckpointManager
from phalanx.checkpoint.state import Counter

_RUN_COUNTER = "_preemption_run_calls"  # where the handler keeps total_run_calls in the checkpoint


@dataclass(frozen=True)
class TerminationConfig:
    """How termination is noticed and handled (``tf.distribute.experimental.TerminationConfig``).

    Attributes:
        termination_watcher_fn: polled once per step on every process; True means "stop soon"
            (e.g. a cloud metadata preemption notice). SIGTERM is always watched.
        exit_fn: called after the save instead of ``sys.exit(42)``.
        save_fn: called instead of ``manager.save()`` (on every process, at the agreed step).
        grace_period: seconds between the notice and the kill (TF's). phalanx saves at the next
            step all processes agree on, whatever the grace period, so it is kept for TF's
            signature and not used.
    """

    termination_watcher_fn: Callable[[], bool] | None = None
    exit_fn: Callable[[], None] | None = None
    grace_period: int | None = None
    save_fn: Callable[[], None] | None = None


class PreemptionCheckpointHandler:
    """Runs training steps and, on a termination notice to any process, saves and exits at an agreed step.

    Args:
        cluster_resolver: the job's cluster resolver (``strategy.cluster_resolver``); kept for TF's
            signature, the processes are those of the current strategy.
        checkpoint_or_checkpoint_manager: a :class:`CheckpointManager`, or a
            :class:`~phalanx.checkpoint.Checkpoint` together with ``checkpoint_dir``.
        checkpoint_dir: where to save when a Checkpoint is given (one checkpoint is kept).
        termination_config: :class:`TerminationConfig`.

    The handler restores the latest checkpoint of the manager's directory, if there is one,
    when it is created. It handles SIGTERM from then on (create it in the main thread), and under
    Slurm SIGUSR1 too (see the module's description).

    Raises:
        ValueError: a Checkpoint without ``checkpoint_dir``, or created outside the main thread.
        CheckpointNotFoundError: Slurm requeued the job (``SLURM_RESTART_COUNT`` > 0) and the
            directory holds no checkpoint; names the directory and the restart count.
    """

    def __init__(
        self,
        cluster_resolver: Any,
        checkpoint_or_checkpoint_manager: Checkpoint | CheckpointManager,
        checkpoint_dir: str | None = None,
        termination_config: TerminationConfig | None = None,
    ) -> None:
        from phalanx.launch.runner import RESTART_EXIT_CODE

        target = checkpoint_or_checkpoint_manager
        if isinstance(target, CheckpointManager):
            self._manager = target
        elif isinstance(target, Checkpoint):
            if checkpoint_dir is None:
                raise ValueError(
                    "PreemptionCheckpointHandler with a Checkpoint needs checkpoint_dir; or pass a CheckpointManager"
                )
            self._manager = CheckpointManager(target, checkpoint_dir, max_to_keep=1)
        else:
            raise TypeError(f"expected a Checkpoint or CheckpointManager; received {type(target).__name__}")
        if threading.current_thread() is not threading.main_thread():
            raise ValueError(
                "Create the PreemptionCheckpointHandler in the main thread (it installs a SIGTERM "
                "handler, which Python allows only there)."
            )
        self.cluster_resolver = cluster_resolver
        self._config = termination_config or TerminationConfig()
        self._exit_code = RESTART_EXIT_CODE
        checkpoint = self._manager.checkpoint
        self._who = checkpoint._participants()
        self._run_calls = Counter(0)
        checkpoint._track(_RUN_COUNTER, self._run_calls)
        self._noticed = threading.Event()
        self._previous = {signal.SIGTERM: signal.signal(signal.SIGTERM, self._on_signal)}
        warning = _slurm_warning_signal()
        if warning is not None:
            self._previous[warning] = signal.signal(warning, self._on_signal)
        self._closed = False
        restored = self._manager.restore_or_initialize()
        restarts = os.environ.get("SLURM_RESTART_COUNT", "0").strip()
        if restored is None and restarts.isdigit() and int(restarts) > 0:
            self.close()
            raise CheckpointNotFoundError(
                self._manager.directory,
                hint=f"SLURM_RESTART_COUNT={restarts}: Slurm requeued this job, but its checkpoint directory holds "
                "no checkpoint to resume from; put it on storage every node shares and that outlives the job (or, "
                "to start over on purpose, `unset SLURM_RESTART_COUNT` before srun)",
            )

    def _on_signal(self, signum: int, frame: Any) -> None:
        # Only note it: the step in progress finishes, then every process agrees to stop.
        self._noticed.set()

    @property
    def total_run_calls(self) -> int:
        """Steps run through this handler, across restarts (restored from the checkpoint)."""
        return self._run_calls.value

    def run(self, distributed_train_function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Runs one step, then saves and exits if any process was told to stop (collective)."""
        result = distributed_train_function(*args, **kwargs)
        self.save_checkpoint_if_preempted()
        return result

    def save_checkpoint_if_preempted(self, *args: Any, **kwargs: Any) -> None:
        """Counts a step run by the caller, then saves and exits if any process was told to stop."""
        self._run_calls.assign_add(1)
        local = self._noticed.is_set() or bool(
            self._config.termination_watcher_fn and self._config.termination_watcher_fn()
        )
        if not self._who.any(local):
            return
        step = self.total_run_calls
        if self._config.save_fn is not None:
            self._config.save_fn()
            where = "by save_fn"
        else:
            where = f"to {self._manager.save(check_interval=False)}"
        print(
            f"phalanx: termination notice{' received here' if local else ' on a peer'}; all processes "
            f"stopped after step {step}, saved {where}; exiting with code {self._exit_code} to be restarted",
            file=sys.stderr,
            flush=True,
        )
        if self._config.exit_fn is not None:
            self._config.exit_fn()
        else:
            sys.exit(self._exit_code)

    @contextlib.contextmanager
    def watch_preemption_scope(self) -> Iterator[None]:
        """TF's scope for :meth:`save_checkpoint_if_preempted`; signals are watched from construction."""
        yield

    def close(self) -> None:
        """Puts back the signal handlers that were there before."""
        if not self._closed:
            for signum, previous in self._previous.items():
                signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
            self._closed = True

    def __enter__(self) -> "PreemptionCheckpointHandler":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _slurm_warning_signal() -> signal.Signals | None:
    """SIGUSR1 in a Slurm job, where it is free: the signal ``sbatch --signal=USR1@N`` sends before
    the time limit. None outside Slurm, where the program handles SIGUSR1 itself (its handler is
    kept), or where SIGUSR1 is phalanx's stack-dump signal (``PHALANX_STACK_SIGNAL``)."""
    from phalanx.config import stack_signal

    if "SLURM_JOB_ID" not in os.environ or not hasattr(signal, "SIGUSR1"):
        return None
    if signal.getsignal(signal.SIGUSR1) not in (signal.SIG_DFL, None) or stack_signal() == signal.SIGUSR1:
        return None
    return signal.SIGUSR1
