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

    python -m benchmarks.checkpoint_verify --bitflips [--per-file 64] [--out ...]

counts what one-bit flips in a real checkpoint do (issue 29): two checkpoints of a model, an Adam
optimizer, a step counter and a user value are saved; then, one at a time, a bit of the newest
is flipped (positions spread uniformly over every file, each bit position within a byte in turn,
plus the targeted ones: the step counter, the learning rate, beta1, the user value and an
optimizer state key in the manifest), it is restored through ``restore_or_initialize()`` and
through ``Checkpoint.restore(path)``, and the flip is undone. No restore may come back with
state other than the previous checkpoint's (``restored_wrong`` must be 0): the manager must fall
back with one warning naming the damaged file, the explicit restore must refuse with a
``CheckpointError`` naming it.
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import os
import re
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from phalanx.checkpoint import Checkpoint, CheckpointError, CheckpointManager, Counter, latest_checkpoint, storage


def _objects(mb: int) -> dict:
    torch.manual_seed(0)
    n = mb * 2**20 // 4 // 4  # four float32 tensors of mb/4 MB each
    return {f"w{i}": torch.randn(n) for i in range(4)}


# --------------------------------------------------------------------------- bit flips
# Targeted flips of the manifest (issue 29): (regex whose group 1 is the byte, bit, what it becomes).
TARGETED = {
    "step counter 3 -> 7": (r'"value": (3)\b', 2),
    "lr 0.01 -> 0.05": (r'"lr": 0\.0(1)\b', 2),
    "beta1 0.9 -> 0.1": (r'"__tuple__": \[\s*0\.(9),', 3),
    "user value epochs 7 -> 3": (r'"epochs": \{[^}]*"state": (7)\b', 2),
    "optimizer key exp_avg_sq -> exp_avg_Sq": (r'"exp_avg_(s)q"', 5),
}


def _training_state(seed: int) -> tuple[Checkpoint, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01, betas=(0.9, 0.999))
    return Checkpoint(model=model, optimizer=optimizer, step=Counter(), epochs=0), optimizer


def _snapshot(ckpt: Checkpoint) -> dict[str, Any]:
    return {
        "model": {k: v.clone() for k, v in ckpt.model.state_dict().items()},
        "optimizer": copy.deepcopy(ckpt.optimizer.state_dict()),  # its tensors change at the next step
        "step": int(ckpt.step),
        "epochs": ckpt.epochs,
        "save_counter": int(ckpt.save_counter),
    }


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


class _Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def flip_positions(size: int, count: int) -> list[int]:
    """``count`` bit positions spread uniformly over a file of ``size`` bytes, each bit of a byte in turn."""
    count = min(count, 8 * size)
    return sorted({(i * size // count) * 8 + i % 8 for i in range(count)})


def _flip(file: str, bit: int) -> bytes:
    data = Path(file).read_bytes()
    damaged = bytearray(data)
    damaged[bit // 8] ^= 1 << (bit % 8)
    Path(file).write_bytes(bytes(damaged))
    return data


def bitflip_counts(directory: str, per_file: int = 64, manifest_flips: int = 96) -> dict[str, Any]:
    """Flips bits of a real checkpoint one at a time and counts what restoring it does.

    Args:
        directory: an empty directory to save the checkpoints in.
        per_file: flips per file of the checkpoint (``manifest_flips`` for ``MANIFEST.json``).

    Returns:
        The counts: ``flips``; for the manager, ``fell_back_with_warning`` (right), and the wrong
        outcomes ``fell_back_silently``, ``manager_refused``, ``accepted_damaged`` (the damaged
        checkpoint restored unchanged state: a byte nothing checked); for ``restore(path)``,
        ``refused`` (right) and ``restore_accepted_damaged``, ``untyped_errors``; and
        ``restored_wrong`` (wrong state, either way: must be 0). ``failures`` lists the first few
        wrong outcomes.
    """
    ckpt, optimizer = _training_state(0)
    manager = CheckpointManager(ckpt, directory, max_to_keep=5)
    expected = []
    for steps in (1, 2):  # ckpt-1 after 1 step (step=1), ckpt-2 after 3 (step=3, as in the issue)
        for _ in range(steps):
            ckpt.model(torch.randn(4, 3)).sum().backward()
            optimizer.step()
            ckpt.step.assign_add(1)
        ckpt.epochs = 7
        manager.save()
        expected.append(_snapshot(ckpt))
    older, newest = manager.checkpoints
    counts = dict.fromkeys(
        (
            "flips",
            "fell_back_with_warning",
            "fell_back_silently",
            "manager_refused",
            "accepted_damaged",
            "refused",
            "restore_accepted_damaged",
            "untyped_errors",
            "restored_wrong",
        ),
        0,
    )
    per_name: dict[str, int] = {}
    failures: list[str] = []
    flips: list[tuple[str, int, str]] = []
    for name in sorted(os.listdir(newest)):
        size = os.path.getsize(os.path.join(newest, name))
        n = manifest_flips if name == storage.MANIFEST else per_file
        flips += [(name, bit, f"bit {bit}") for bit in flip_positions(size, n)]
    text = Path(newest, storage.MANIFEST).read_text()
    for what, (pattern, bit) in TARGETED.items():
        match = re.search(pattern, text)
        assert match is not None, f"{what}: {pattern} not in the manifest"
        flips.append((storage.MANIFEST, match.start(1) * 8 + bit, what))
    handler = _Warnings()
    logger = logging.getLogger("phalanx.checkpoint")
    logger.addHandler(handler)
    try:
        for name, bit, what in flips:
            file = os.path.join(newest, name)
            original = _flip(file, bit)
            try:
                label = f"{name} {what}"
                counts["flips"] += 1
                per_name[name] = per_name.get(name, 0) + 1
                # Through the manager, as a restarted process would (nothing verified yet).
                storage.forget_verified()
                handler.messages.clear()
                live, _ = _training_state(1)
                try:
                    chosen = CheckpointManager(live, directory, max_to_keep=5).restore_or_initialize()
                    state = _snapshot(live)
                except CheckpointError as e:
                    counts["manager_refused"] += 1
                    failures.append(f"{label}: manager refused: {e}")
                    chosen = state = None
                except Exception as e:  # noqa: BLE001 - counted: an untyped error is an outcome
                    counts["untyped_errors"] += 1
                    failures.append(f"{label}: manager: {type(e).__name__}: {e}")
                    chosen = state = None
                if chosen == older and _same(state, expected[0]):
                    warned = [m for m in handler.messages if newest in m and name in m]
                    if len(handler.messages) == 1 and warned and latest_checkpoint(directory) == older:
                        counts["fell_back_with_warning"] += 1
                    else:
                        counts["fell_back_silently"] += 1
                        failures.append(f"{label}: fell back with the warnings {handler.messages}")
                elif chosen == newest and _same(state, expected[1]):
                    counts["accepted_damaged"] += 1
                    failures.append(f"{label}: the manager restored the damaged checkpoint")
                elif chosen is not None:
                    counts["restored_wrong"] += 1
                    failures.append(f"{label}: the manager restored wrong state from {chosen}")
                # Through an explicit restore of the damaged path.
                storage.forget_verified()
                live, _ = _training_state(1)
                try:
                    live.restore(newest)
                except CheckpointError as e:
                    if name in str(e):
                        counts["refused"] += 1
                    else:
                        counts["untyped_errors"] += 1
                        failures.append(f"{label}: restore refused without naming {name}: {e}")
                    continue
                except Exception as e:  # noqa: BLE001 - counted: an untyped error is an outcome
                    counts["untyped_errors"] += 1
                    failures.append(f"{label}: restore: {type(e).__name__}: {e}")
                    continue
                if _same(_snapshot(live), expected[1]):
                    counts["restore_accepted_damaged"] += 1
                    failures.append(f"{label}: restore(path) accepted the damaged checkpoint")
                else:
                    counts["restored_wrong"] += 1
                    failures.append(f"{label}: restore(path) restored wrong state")
            finally:
                Path(file).write_bytes(original)
    finally:
        logger.removeHandler(handler)
        storage.forget_verified()
    return {**counts, "flips_per_file": per_name, "failures": failures[:20]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=128, help="checkpoint size in MB")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--bitflips", action="store_true", help="count what one-bit flips do instead")
    parser.add_argument("--per-file", type=int, default=64, help="with --bitflips: flips per file")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.bitflips:
        with tempfile.TemporaryDirectory() as directory:
            result = bitflip_counts(directory, per_file=args.per_file, manifest_flips=args.per_file * 3 // 2)
        print(json.dumps(result, indent=1))
        if args.out:
            Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
        return
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
