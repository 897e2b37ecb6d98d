"""Runs every conformance case under one strategy, on every process of the job (SPMD).

Usage: python runner.py STRATEGY OUT_DIR [START [ATTEMPT [SUITE]]]

STRATEGY is one of registry.ALL; SUITE is ``tf`` (the default: TF's tensorflow/python/distribute
tests, ``cases_*.py``) or ``keras`` (tf_keras/distribute's tests, ``keras/cases_*.py``). Each process appends one JSON line per case to
OUT_DIR/results_<rank>.jsonl: ``{"idx", "id", "status": passed|failed|error, "text"}``. After each
case the processes meet at a barrier made of files (OUT_DIR/sync/<attempt>/<idx>_<rank>.json),
outside the communicator: a case that raised on one process while another waits in a collective
ends in that collective's timeout (keep PHALANX_COLLECTIVE_TIMEOUT low), never in the next case.
When a case broke the communicator (any DistributedRuntimeError: a timeout, a mismatch) or a peer
did not reach the barrier, every process exits with status 3 and the harness starts a new job at
the next case (START). OUT_DIR/done_<rank> marks a job that ran to the end.
"""

from __future__ import annotations

import importlib
import json
import os
import pkgutil
import sys
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
TESTS = HERE.parent
# Run as a script, this folder is sys.path[0]: its keras/ (the Keras suite) would shadow Keras itself.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]
RESTART = 3  # exit status: the communicator is unusable; start again at the next case


def load_cases(suite: str = "tf") -> list:
    """Imports every ``cases_*`` module of ``suite`` (sorted) and returns its cases, in that order."""
    if str(TESTS) not in sys.path:
        sys.path.insert(0, str(TESTS))
    from tf_conformance import registry

    if suite not in registry.SUITES:
        raise ValueError(f"unknown conformance suite {suite!r}; expected one of {registry.SUITES}")
    name = "tf_conformance" if suite == "tf" else "tf_conformance.keras"
    package = importlib.import_module(name)
    for info in sorted(pkgutil.iter_modules(package.__path__), key=lambda m: m.name):
        if info.name.startswith("cases_"):
            importlib.import_module(f"{name}.{info.name}")
    return [c for c in registry.CASES if c.suite == suite]


def _record(error: BaseException | None) -> dict:
    if error is None:
        return {"status": "passed", "text": ""}
    tb = "".join(traceback.format_exception(error))
    if isinstance(error, AssertionError):
        return {"status": "failed", "text": str(error)[:1500], "tb": tb[-1500:]}
    return {
        "status": "error",
        "type": type(error).__name__,
        "text": f"{type(error).__name__}: {str(error)[:1500]}",
        "tb": tb[-2500:],
        "breaks": _breaks_communicator(error),
    }


def _breaks_communicator(error: BaseException) -> bool:
    from phalanx.errors import DistributedRuntimeError

    return isinstance(error, DistributedRuntimeError) or type(error).__module__.startswith("torch.distributed")


def _alive(sync: Path, rank: int) -> bool:
    """Whether process ``rank`` of this attempt still runs (a crashed peer ends the wait at once)."""
    try:
        pid = int((sync / f"pid_{rank}").read_text())
    except (FileNotFoundError, ValueError):
        return True  # not started yet: the deadline decides
    try:
        import psutil

        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except Exception:  # noqa: BLE001 - gone (NoSuchProcess) or unreadable: treat as gone
        return False


def _barrier(sync: Path, idx: int, rank: int, world: int, record: dict, timeout: float) -> list[dict] | None:
    """Every process's record of case ``idx``, or None when a peer died or did not arrive in time."""
    mine = sync / f"{idx}_{rank}.json"
    tmp = mine.with_suffix(".tmp")
    tmp.write_text(json.dumps(record))
    tmp.replace(mine)
    deadline = time.monotonic() + timeout
    paths = [sync / f"{idx}_{r}.json" for r in range(world)]
    polls = 0
    while not all(p.exists() for p in paths):
        polls += 1
        if time.monotonic() > deadline:
            return None
        if polls % 20 == 0 and not all(_alive(sync, r) for r, p in enumerate(paths) if not p.exists()):
            return None
        time.sleep(0.005)
    return [json.loads(p.read_text()) for p in paths]


def main() -> int:
    name, out = sys.argv[1], Path(sys.argv[2])
    start = int(sys.argv[3]) if len(sys.argv) > 3 else 0
    attempt = sys.argv[4] if len(sys.argv) > 4 else "0"
    suite = sys.argv[5] if len(sys.argv) > 5 else "tf"
    os.environ.setdefault("KERAS_BACKEND", "torch")
    cases = load_cases(suite)
    from tf_conformance import registry

    import strategies  # tests/strategies.py: the matrix's factories

    strategy = strategies.make(name)
    ext = strategy.extended
    rank, n = ext.process_index, strategy.num_replicas_in_sync
    world = ext.num_processes
    ctx = registry.Ctx(
        name=name,
        rank=rank,
        n=n,
        local_n=1 if name == registry.MULTI_WORKER else n,
        worker=rank if name == registry.MULTI_WORKER else 0,
    )
    sync = out / "sync" / attempt
    sync.mkdir(parents=True, exist_ok=True)
    (sync / f"pid_{rank}").write_text(str(os.getpid()))
    barrier_timeout = float(os.environ.get("PHALANX_COLLECTIVE_TIMEOUT", "300")) + 10.0
    results = open(out / f"results_{rank}.jsonl", "a")  # noqa: SIM115 - one line per case, flushed
    for idx, c in enumerate(cases):
        if idx < start or name not in c.strategies:
            continue
        (out / f"current_{rank}").write_text(str(idx))
        began = time.monotonic()
        error: BaseException | None = None
        try:
            c.fn(strategy, ctx)
        except BaseException as e:  # noqa: BLE001 - recorded; StopIteration and KeyboardInterrupt too
            if isinstance(e, (SystemExit, KeyboardInterrupt)):
                raise
            error = e
        record = {"idx": idx, "id": c.id, "rank": rank, **_record(error), "seconds": round(time.monotonic() - began, 3)}
        results.write(json.dumps(record) + "\n")
        results.flush()
        if world > 1:
            everyone = _barrier(sync, idx, rank, world, record, barrier_timeout)
            if everyone is None:
                print(f"conformance: a peer did not finish case {c.id}; restarting after it", flush=True)
                return RESTART
            if any(r.get("breaks") for r in everyone):
                print(f"conformance: case {c.id} broke the communicator; restarting after it", flush=True)
                return RESTART
    results.close()
    (out / f"done_{rank}").write_text("ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
