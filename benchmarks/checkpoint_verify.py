"""What verifying the latest checkpoint costs a restart: ``restore_or_initialize()`` vs a bare restore.

    python -m benchmarks.checkpoint_verify [--mb 128] [--rounds 7] [--out benchmarks/results/checkpoint_verify.json]

``restore_or_initialize()`` verifies the checkpoint it chooses (size and SHA-256 of every file,
against the manifest) before restoring it, so that a damaged save is skipped; a bare
``Checkpoint.restore(path)`` of a known path checks each file's SHA-256 while loading it. Both
read and hash every byte once: the restore that follows a verification does not hash again
(``storage.VerifiedFiles``). Each round times both on the same checkpoint, in alternating order,
with the process's verification memory cleared first (as a restarted process starts); the figure
is the median of the per-round ratios. The page cache is warm for both (the file was just read),
so the ratio shows the CPU cost of verification, not the disk's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from phalanx.checkpoint import Checkpoint, CheckpointManager, storage


def _objects(mb: int) -> dict:
    torch.manual_seed(0)
    n = mb * 2**20 // 4 // 4  # four float32 tensors of mb/4 MB each
    return {f"w{i}": torch.randn(n) for i in range(4)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=128, help="checkpoint size in MB")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as directory:
        CheckpointManager(Checkpoint(**_objects(args.mb)), directory, max_to_keep=1).save()
        live = Checkpoint(**{k: torch.zeros_like(v) for k, v in _objects(args.mb).items()})
        manager = CheckpointManager(live, directory, max_to_keep=1)
        path = manager.latest_checkpoint

        def bare() -> float:
            storage.forget_verified()
            start = time.perf_counter()
            live.restore(path)
            return time.perf_counter() - start

        def verified() -> float:
            storage.forget_verified()
            start = time.perf_counter()
            manager.restore_or_initialize()
            return time.perf_counter() - start

        bare(), verified()  # warm the page cache and the allocator
        ratios, times = [], {"bare": [], "verified": []}
        for r in range(args.rounds):
            order = [("bare", bare), ("verified", verified)][:: 1 if r % 2 == 0 else -1]
            t = {name: fn() for name, fn in order}
            for name in t:
                times[name].append(t[name])
            ratios.append(t["verified"] / t["bare"])
    result = {
        "checkpoint_mb": args.mb,
        "rounds": args.rounds,
        "bare_restore_s_median": statistics.median(times["bare"]),
        "restore_or_initialize_s_median": statistics.median(times["verified"]),
        "ratio_median": statistics.median(ratios),
        "ratios": ratios,
    }
    print(json.dumps(result, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
