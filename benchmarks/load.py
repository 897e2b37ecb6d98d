"""A background load for the loaded rows of ``python -m benchmarks --load``.

Real machines are busy while they train: DataLoader workers, a tokenizer, a second job, a noisy
neighbour. The load here is one busy process per core and one torch DataLoader with 2 worker
processes that do CPU work per item, each load process in a session of its own, started just
before a job and ended just after it. The job starts only once every load process is at work
(under the busy processes, the DataLoader takes 1.5-2.5 s to import torch on a 2-core VM, longer
than the fixed one-second head start it used to get), and ``cores`` tells what the load took
while the job ran. Usage::

    with BackgroundLoad() as load:
        run_the_job()
    print(load.cores)  # CPU time of every load process / wall time, while the job ran

    python -m benchmarks.load busy|dataloader   # one load process (what BackgroundLoad starts)
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DESCRIPTION = "one busy process per core + one DataLoader with 2 workers"


class BackgroundLoad:
    """Starts the load on entry and ends every process of it on exit (its own session, SIGKILL).

    Args:
        busy: busy processes (default: one per core this process may use).
        dataloader_workers: worker processes of the DataLoader (0: no DataLoader).
    """

    def __init__(self, busy: int | None = None, dataloader_workers: int = 2) -> None:
        try:
            cores = len(os.sched_getaffinity(0))
        except (AttributeError, OSError):
            cores = os.cpu_count() or 1
        self.busy = cores if busy is None else busy
        self.dataloader_workers = dataloader_workers
        self._procs: list[subprocess.Popen] = []
        self.cores: float | None = None  # what the load took while the job ran, in cores
        self._started: tuple[float, float] | None = None

    def __enter__(self) -> BackgroundLoad:
        env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        kinds = [["busy"]] * self.busy
        if self.dataloader_workers:
            kinds.append(["dataloader", str(self.dataloader_workers)])
        try:
            for args in kinds:
                self._procs.append(
                    subprocess.Popen(
                        [sys.executable, "-m", "benchmarks.load", *args],
                        cwd=ROOT,
                        env=env,
                        stdout=subprocess.PIPE,  # one line, "ready", once at work
                        stderr=subprocess.DEVNULL,
                        start_new_session=True,  # its DataLoader workers are ended with it
                    )
                )
            deadline = time.monotonic() + _READY_TIMEOUT_S
            for p in self._procs:
                if not select.select([p.stdout], [], [], max(0.0, deadline - time.monotonic()))[0]:
                    raise TimeoutError(f"load process {p.args[3:]} not at work after {_READY_TIMEOUT_S:.0f} s")
                if p.stdout.readline().strip() != b"ready":
                    raise RuntimeError(f"load process {p.args[3:]} exited with {p.wait()} before it was at work")
            self._started = (time.monotonic(), self._cpu_s())
        except BaseException:
            self.__exit__()
            raise
        return self

    def _cpu_s(self) -> float:
        """CPU seconds used so far by every process of the load's sessions (DataLoader workers too)."""
        sessions, total = {p.pid for p in self._procs}, 0
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    with open(f"/proc/{entry}/stat", "rb") as f:
                        fields = f.read().rsplit(b")", 1)[1].split()
                except OSError:  # exited meanwhile
                    continue
                if int(fields[3]) in sessions:  # field 6, the session id
                    total += int(fields[11]) + int(fields[12])  # fields 14, 15: utime, stime in ticks
        return total / os.sysconf("SC_CLK_TCK")

    def __exit__(self, *exc: object) -> None:
        if self._started is not None:
            wall = time.monotonic() - self._started[0]
            self.cores = (self._cpu_s() - self._started[1]) / wall if wall > 0 else None
            self._started = None
        for p in self._procs:
            try:
                os.killpg(p.pid, signal.SIGKILL)  # the session this process leads: it and its workers
            except ProcessLookupError:
                pass
        for p in self._procs:
            p.wait(timeout=30)
            p.stdout.close()
        self._procs = []


_READY_TIMEOUT_S = 60.0


def _ready() -> None:
    sys.stdout.write("ready\n")
    sys.stdout.flush()


def _busy() -> None:
    _ready()
    x = 0
    while True:
        x = (x * 1103515245 + 12345) & 0x7FFFFFFF


def _dataloader(workers: int) -> None:
    import numpy as np
    import torch

    torch.set_num_threads(1)

    class Work(torch.utils.data.Dataset):
        """Items that cost CPU, as decoding and augmenting would: a sort of 200k floats."""

        def __len__(self) -> int:
            return 1 << 30

        def __getitem__(self, i: int) -> torch.Tensor:
            rng = np.random.default_rng(i)
            return torch.from_numpy(np.sort(rng.random(200_000, dtype=np.float32))[:16].copy())

    for i, _ in enumerate(torch.utils.data.DataLoader(Work(), batch_size=8, num_workers=workers)):
        if i == 0:  # its workers are up and producing
            _ready()


if __name__ == "__main__":
    if sys.argv[1] == "busy":
        _busy()
    elif sys.argv[1] == "dataloader":
        _dataloader(int(sys.argv[2]))
    else:
        sys.exit(f"unknown load {sys.argv[1]!r}: busy or dataloader")
