"""A background load for the loaded rows of ``python -m benchmarks --load``.

Real machines are busy while they train: DataLoader workers, a tokenizer, a second job, a noisy
neighbour. The load here is one busy process per core and one torch DataLoader with 2 worker
processes that do CPU work per item, all in one process group of their own that is started just
before a job and ended just after it. Usage::

    with BackgroundLoad():
        run_the_job()

    python -m benchmarks.load busy|dataloader   # one load process (what BackgroundLoad starts)
"""

from __future__ import annotations

import os
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
                        stdout=subprocess.DEVNULL,
                        stderr=subprocess.DEVNULL,
                        start_new_session=True,  # its DataLoader workers are ended with it
                    )
                )
            time.sleep(1.0)  # the DataLoader's workers are up and busy before the job starts
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        for p in self._procs:
            try:
                os.killpg(p.pid, signal.SIGKILL)  # the session this process leads: it and its workers
            except ProcessLookupError:
                pass
        for p in self._procs:
            p.wait(timeout=30)
        self._procs = []


def _busy() -> None:
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

    for _ in torch.utils.data.DataLoader(Work(), batch_size=8, num_workers=workers):
        pass


if __name__ == "__main__":
    if sys.argv[1] == "busy":
        _busy()
    elif sys.argv[1] == "dataloader":
        _dataloader(int(sys.argv[2]))
    else:
        sys.exit(f"unknown load {sys.argv[1]!r}: busy or dataloader")
