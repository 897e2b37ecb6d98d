"""A notice, once per process, when the processes a launcher started and the strategy disagree.

TensorFlow runs both of these silently, and so does phalanx, but a newcomer loses an hour
wondering why nothing got faster:

* a one-replica strategy (``OneDeviceStrategy``) in one of N processes that a launcher started
  (``phalanx run -n N``, torchrun, Slurm, a ``TF_CONFIG`` cluster): each process trains its own,
  independent copy of the model;
* ``MultiWorkerMirroredStrategy()`` in a process that no launcher started and no cluster
  describes: it trains on that process alone, as one replica.

The notice goes to stderr (replica 0's is on the terminal, the others' in their logs) and says how
to fix it either way. A program whose processes already train together (a multi-replica strategy
before the one-replica one, as TF's tutorials build an evaluation strategy beside the training one)
gets none.

Example:
    >>> launched_processes({"WORLD_SIZE": "4", "RANK": "1"})
    Launched(count=4, launcher='torchrun', rank=1)
    >>> launched_processes({})
    Launched(count=1, launcher=None, rank=0)
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping
from typing import NamedTuple

from phalanx.comm.communicator import in_multi_process_job
from phalanx.launch.env import ReplicaEnv

_told: set[str] = set()  # the notices this process has given


class Launched(NamedTuple):
    """How many processes started this job together, by what (None: nothing), and this one's rank."""

    count: int
    launcher: str | None
    rank: int


def launched_processes(environ: Mapping[str, str] | None = None) -> Launched:
    """How this process was launched (see :class:`Launched`).

    Never raises: a malformed variable is the resolvers' to report, with its name and value.
    """
    env = os.environ if environ is None else environ
    try:
        replica = ReplicaEnv.from_environ(env)
    except Exception:  # noqa: BLE001 - reported by the strategy that reads it
        replica = None
    if replica is not None:
        return Launched(replica.world_size, "phalanx run", replica.rank)
    if "RANK" in env and _count(env.get("WORLD_SIZE")):  # torchrun's pair (a lone WORLD_SIZE may be anyone's)
        return Launched(_count(env.get("WORLD_SIZE")), "torchrun", _count(env.get("RANK")))
    if "SLURM_PROCID" in env and _count(env.get("SLURM_NTASKS")):
        return Launched(_count(env.get("SLURM_NTASKS")), "Slurm", _count(env.get("SLURM_PROCID")))
    try:
        config = json.loads(env.get("TF_CONFIG") or "{}")
        cluster, task = config.get("cluster") or {}, config.get("task") or {}
        count = sum(len(cluster.get(job) or []) for job in ("chief", "worker"))
        first = task.get("type") == ("chief" if cluster.get("chief") else "worker") and task.get("index", 0) == 0
    except (ValueError, AttributeError, TypeError):
        count, first = 0, True
    if count:
        return Launched(count, "TF_CONFIG", 0 if first else 1)
    return Launched(1, None, 0)


def _count(raw: str | None) -> int:
    return int(raw) if raw is not None and raw.strip().isdigit() else 0


def _tell(key: str, message: str) -> None:
    if key in _told:
        return
    _told.add(key)
    print(f"phalanx: {message}", file=sys.stderr, flush=True)


def one_replica_strategy(strategy: str) -> None:
    """``strategy`` trains one replica in this process alone: a notice if a launcher started N > 1.

    Told by the launched job's first process, whose output is the terminal's (the others' would
    repeat it in their logs), unless this program's processes already train together.
    """
    count, launcher, rank = launched_processes()
    if count <= 1 or rank != 0 or in_multi_process_job():
        return
    program = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "train.py"
    _tell(
        "one-replica",
        f"{launcher} started {count} processes, but {strategy} trains in each one alone: they train "
        f"{count} independent copies of the model. To train one model on all of them, use "
        f"MultiWorkerMirroredStrategy() (or MirroredStrategy with {count} devices); to train one copy, "
        f"run the program once (python {program}).",
    )


def lone_multi_worker(strategy: str) -> None:
    """``strategy`` found no cluster and no launcher: a notice that it trains one replica here."""
    if launched_processes().launcher is not None:
        return
    _tell(
        "lone-multi-worker",
        f"{strategy} found no cluster (no TF_CONFIG, no launcher's variables): it trains on this "
        "process alone, as one replica. To train on N processes of this host, run it with "
        "`phalanx run -n N`; on several hosts, set TF_CONFIG or use `phalanx run --nnodes`; for this "
        "host's devices without a launcher, use MirroredStrategy().",
    )
