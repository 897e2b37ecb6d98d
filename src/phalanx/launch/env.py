"""The environment through which a launcher tells a replica process who it is.

``phalanx run`` and MirroredStrategy's self-launch set these variables for every replica;
strategies read them back with :meth:`ReplicaEnv.from_environ`.

Example:
    >>> from phalanx.launch.env import ReplicaEnv
    >>> env = ReplicaEnv(rank=1, world_size=2, local_rank=1, local_world_size=2,
    ...                  master_addr="127.0.0.1", master_port=29500)
    >>> ReplicaEnv.from_environ(env.to_environ()) == env
    True
"""

from __future__ import annotations

import dataclasses
import errno
import os
import random
import socket
import threading
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, fields

from phalanx.errors import ClusterSpecError

PREFIX = "PHALANX_"
# Set by a launcher for each child it starts (not user settings): the launcher's pid, which the
# replica watches so that it dies with it, and the file a replica writes when its program ends
# (the supervisor); a forked program's connection to its fork server (phalanx.launch.forkserver);
# the address, secret and rank of a spawned notebook replica (phalanx.interactive); the run directory
# whose diagnosis of a failed collective the supervisor prints (phalanx.comm.diagnosis).
SUPERVISOR_VARIABLES = (
    "PHALANX_PARENT_PID",
    "PHALANX_DONE_FILE",
    "PHALANX_DIAGNOSIS_DIR",
    "PHALANX_FORK_SERVER",
    "PHALANX_INTERACTIVE_ADDR",
    "PHALANX_INTERACTIVE_SECRET",
    "PHALANX_INTERACTIVE_RANK",
)


@dataclass(frozen=True)
class ReplicaEnv:
    """Identity of one replica process."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int
    node_rank: int = 0
    num_nodes: int = 1
    run_id: str = ""
    log_dir: str = ""

    def to_environ(self) -> dict[str, str]:
        return {PREFIX + f.name.upper(): str(getattr(self, f.name)) for f in fields(self)}

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> ReplicaEnv | None:
        """The replica identity in ``environ``, or None when this process was not launched by phalanx."""
        environ = os.environ if environ is None else environ
        if PREFIX + "RANK" not in environ:
            return None
        values = {}
        for f in fields(cls):
            key = PREFIX + f.name.upper()
            if key not in environ:
                if f.default is not dataclasses.MISSING:
                    continue
                raise ClusterSpecError(key, None, "is missing while PHALANX_RANK is set")
            raw = environ[key]
            if f.type in ("int", int):
                try:
                    values[f.name] = int(raw)
                except ValueError:
                    raise ClusterSpecError(key, raw, "must be an integer") from None
            else:
                values[f.name] = raw
        env = cls(**values)
        if not 0 <= env.rank < env.world_size:
            raise ClusterSpecError(PREFIX + "RANK", env.rank, f"must be in [0, {env.world_size})")
        return env

    @classmethod
    def local_chief(cls, world_size: int, run_id: str, log_dir: str) -> ReplicaEnv:
        """Replica 0 of a single-host job whose replicas this process starts (self-launch, notebooks)."""
        return cls(
            rank=0,
            world_size=world_size,
            local_rank=0,
            local_world_size=world_size,
            master_addr="127.0.0.1",
            master_port=free_port(),
            run_id=run_id,
            log_dir=log_dir,
        )


# free_port's candidates lie outside the kernel's ephemeral range, where no outgoing connection
# takes its local port: below it (above the privileged ports) when that leaves room, else above.
_EPHEMERAL_PORT_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"
_LOWEST_PORT = 1025
_HIGHEST_PORT = 65535
_MIN_ROOM = 1000  # ports outside the range: fewer, and candidates would collide too often
_TRIES = 100
# The ports handed out lately: callers (ps/cluster_launcher) pick several before binding any, and nothing
# bound in between tells a bind check that a port is already promised.
_RECENT_PORTS: deque[int] = deque(maxlen=256)
_RECENT_LOCK = threading.Lock()
# Not the module-level random: a test's fixed seed, or a fork's copied state, would make processes
# picking at the same time draw the same candidates.
_RANDOM = random.SystemRandom()


def _ports_outside_ephemeral_range() -> range | None:
    """The ports free_port picks from, or None when bind(0) must pick (no range read, or no room)."""
    try:
        with open(_EPHEMERAL_PORT_RANGE_FILE) as f:
            low, high = (int(v) for v in f.read().split())
    except (OSError, ValueError):  # not Linux, no /proc, or an unexpected format
        return None
    if low - _LOWEST_PORT >= _MIN_ROOM:
        return range(_LOWEST_PORT, low)
    if _HIGHEST_PORT - high >= _MIN_ROOM:
        return range(high + 1, _HIGHEST_PORT + 1)
    return None


def _bindable(host: str, port: int) -> bool:
    """Whether ``port`` on ``host`` can be bound now, for TCP and for UDP (as portpicker checks)."""
    for kind in (socket.SOCK_STREAM, socket.SOCK_DGRAM):
        with socket.socket(socket.AF_INET, kind) as s:  # SO_REUSEADDR off: a TIME_WAIT use counts too
            try:
                s.bind((host, port))
            except OSError as e:
                if e.errno in (errno.EADDRINUSE, errno.EACCES):
                    return False
                raise  # e.g. a host that is not this machine's: bind(0) would fail the same way
    return True


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` now, for a process to bind later.

    Between this pick and the bind, the port must not be taken by anyone else. A port from bind(0)
    comes from the kernel's ephemeral range (``/proc/sys/net/ipv4/ip_local_port_range``), the
    range from which every outgoing TCP connection on the host takes its local port: a gloo or
    TCPStore client of another job could take it in between, and the bind then fails with
    "address already in use". So, as Google's portpicker does, the port is a random one outside
    that range (below it when that leaves room, else above it) that can be bound now; bind(0) picks
    only when the range cannot be read (not Linux) or leaves no room, or when no candidate was free.
    A port is not handed out twice in quick succession within one process, since callers pick
    several ports before binding any of them.

    Args:
        host: the address the port will be bound to.

    Returns:
        The port number.

    Raises:
        OSError: ``host`` cannot be bound at all (e.g. it is not an address of this machine).
    """
    allowed = _ports_outside_ephemeral_range()
    with _RECENT_LOCK:
        if allowed is not None:
            for _ in range(_TRIES):
                port = _RANDOM.choice(allowed)
                if port not in _RECENT_PORTS and _bindable(host, port):
                    _RECENT_PORTS.append(port)
                    return port
        for _ in range(_TRIES):
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                s.bind((host, 0))
                port = int(s.getsockname()[1])
            if port not in _RECENT_PORTS:
                break
        _RECENT_PORTS.append(port)
        return port
