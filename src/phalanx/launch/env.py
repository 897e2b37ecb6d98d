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
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass, fields

from phalanx.errors import ClusterSpecError

PREFIX = "PHALANX_"
# Set by a launcher for each child it starts (not user settings): the launcher's pid, which the
# replica watches so that it dies with it, and the file a replica writes when its program ends
# (the supervisor); a forked program's connection to its fork server (phalanx.launch.forkserver);
# the address, secret and rank of a spawned notebook replica (phalanx.interactive).
SUPERVISOR_VARIABLES = (
    "PHALANX_PARENT_PID",
    "PHALANX_DONE_FILE",
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


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
