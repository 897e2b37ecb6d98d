"""Multi-replica strategies from Jupyter, IPython, the Python REPL, ``python -c`` and stdin.

Constructing a multi-replica strategy where no script can be started again starts the other
replicas from the interactive process; from then on every cell runs on every replica, in order
(see :mod:`phalanx.interactive.session`).

Example (a notebook; two CPU replicas)::

    import phalanx
    strategy = phalanx.MirroredStrategy(["cpu:0", "cpu:1"])   # starts replica 1
    print(phalanx.interactive.replica_id())                    # 0 here; 1 in replica 1's log
"""

from __future__ import annotations

from phalanx.launch import mode

__all__ = ["replica_id", "num_replicas", "interactive_main"]


def replica_id() -> int:
    """This process's replica index in the current session or launched job (0 when alone)."""
    return mode.current().rank


def num_replicas() -> int:
    """How many replica processes the current session or launched job has (1 when alone)."""
    return mode.current().world_size


def interactive_main() -> bool:
    """Whether this interpreter has no script to restart (IPython, the REPL, ``-c``, stdin)."""
    return mode.interactive_mode() is not None
