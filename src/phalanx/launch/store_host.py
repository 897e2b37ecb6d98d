"""The store of an elastic job, served by a process of its own: ``python -m phalanx.launch.store_host HOST PORT``.

In a job that goes on without lost replicas (``phalanx run --min-nproc``), the store the
replicas meet in (rendezvous, heartbeats, each step's vote, the group's membership) must outlive
any of them, replica 0 included. ``phalanx run`` starts this process beside the replicas (forked
from its fork server, where torch is imported already), as torchrun's agent serves its workers'
store. It listens on the job's own address only and ends when the launcher stops it, or with it.
"""

from __future__ import annotations

import datetime
import signal
import sys
import threading


def serve(host: str, port: int) -> None:
    """Serves the store at ``host:port`` until SIGTERM or SIGINT."""
    import torch.distributed as dist

    from phalanx.comm.rendezvous import listen_socket

    sock = listen_socket(host, port, "the job's store")
    store = dist.TCPStore(  # noqa: F841 - serves while referenced
        host, port, None, True, datetime.timedelta(hours=24), wait_for_workers=False, master_listen_fd=sock.detach()
    )
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    while not stop.wait(1.0):
        pass


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2 or not args[1].isdigit():
        print("usage: python -m phalanx.launch.store_host HOST PORT", file=sys.stderr)
        return 2
    serve(args[0], int(args[1]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
