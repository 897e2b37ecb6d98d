"""The strategy matrix: one named factory per CPU configuration (TF's ``strategy_combinations``).

A test or a test script names a configuration instead of building its strategy with its own
``if kind == ...`` chain, so every configuration is spelled once::

    import strategies
    strategy = strategies.make("mirrored_cpu_2")          # in a script
    strategy = strategies.make("mirrored_cpu", n=3)        # a family with a replica count

Each :class:`Combination` also says how a test launches a script under it (:meth:`Combination.command`):
self-launching strategies are started as ``python script``; multi-worker ones under ``phalanx run``.

Scripts under ``tests/scripts`` put ``tests/`` on ``sys.path`` first (``sys.path.insert(0, TESTS)``).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any, Callable


def _cpus(n: int) -> list[str]:
    return [f"cpu:{i}" for i in range(n)]


def one_device(n: int = 1, **_: Any) -> Any:
    import phalanx as px

    return px.OneDeviceStrategy("cpu")


_CROSS_DEVICE_OPS = {
    "": None,
    "nccl": "NcclAllReduce",
    "one": "ReductionToOneDevice",
    "hier": "HierarchicalCopyAllReduce",
    "packs": "NcclAllReduce(num_packs=3)",
}


def cross_device_ops(name: str) -> Any:
    """A CrossDeviceOps by short name: '' (default), nccl, one, hier, packs."""
    import phalanx as px

    if name not in _CROSS_DEVICE_OPS:
        raise ValueError(f"unknown cross-device ops {name!r}; expected one of {sorted(_CROSS_DEVICE_OPS)}")
    if name == "":
        return None
    if name == "packs":
        return px.NcclAllReduce(num_packs=3)
    return getattr(px, _CROSS_DEVICE_OPS[name])()


def mirrored_cpu(n: int = 2, cross_device_ops_name: str = "", **_: Any) -> Any:
    import phalanx as px

    return px.MirroredStrategy(_cpus(n), cross_device_ops=cross_device_ops(cross_device_ops_name))


def central_storage_cpu(n: int = 2, **_: Any) -> Any:
    import phalanx as px

    return px.CentralStorageStrategy(_cpus(n))


def fully_sharded_cpu(n: int = 2, min_params_to_shard: int = 64, **_: Any) -> Any:
    """FullyShardedStrategy over ``n`` CPU replicas; by default every module of 64 or more parameter
    elements is a sharding group of its own, so small test models shard layer by layer."""
    import phalanx as px

    return px.FullyShardedStrategy(_cpus(n), min_params_to_shard=min_params_to_shard)


def multi_worker(n: int = 2, **_: Any) -> Any:
    import phalanx as px

    return px.MultiWorkerMirroredStrategy()  # who is who: from `phalanx run` / TF_CONFIG


def parameter_server(n: int = 2, **_: Any) -> Any:
    import phalanx as px

    return px.ParameterServerStrategy()  # the cluster: from `phalanx run --ps M --workers N`


@dataclass(frozen=True)
class Combination:
    """One strategy configuration of the matrix.

    Attributes:
        name: its name in the matrix.
        factory: builds the strategy (inside the process that uses it).
        processes: how many processes take part in its collectives (its replicas).
        launch: ``self`` (the script starts its other replicas itself), ``phalanx_run`` (``phalanx
            run -n processes``), ``ps`` (``phalanx run --ps ps --workers processes``).
        options: keyword arguments for the factory.
        ps: parameter servers (``launch == "ps"``).
    """

    name: str
    factory: Callable[..., Any]
    processes: int
    launch: str = "self"
    options: dict[str, Any] = field(default_factory=dict)
    ps: int = 0

    def make(self) -> Any:
        return self.factory(self.processes, **self.options)

    def command(self, script: str, *args: str) -> list[str]:
        """The command that runs ``script args`` under this configuration."""
        if self.launch == "phalanx_run":
            return [sys.executable, "-m", "phalanx.cli", "run", "-n", str(self.processes), script, *args]
        if self.launch == "ps":
            return [
                sys.executable,
                "-m",
                "phalanx.cli",
                "run",
                "--ps",
                str(self.ps),
                "--workers",
                str(self.processes),
                script,
                *args,
            ]
        return [sys.executable, script, *args]


COMBINATIONS: dict[str, Combination] = {
    c.name: c
    for c in [
        Combination("one_device", one_device, 1),
        Combination("mirrored_cpu_2", mirrored_cpu, 2),
        Combination("mirrored_cpu_3", mirrored_cpu, 3),
        Combination("central_storage_cpu_2", central_storage_cpu, 2),
        Combination("central_storage_cpu_3", central_storage_cpu, 3),
        Combination("fully_sharded_cpu_2", fully_sharded_cpu, 2),
        Combination("multi_worker_2", multi_worker, 2, launch="phalanx_run"),
        Combination("parameter_server_1ps_2workers", parameter_server, 2, launch="ps", ps=1),
        Combination("parameter_server_2ps_2workers", parameter_server, 2, launch="ps", ps=2),
    ]
}

#: Families whose replica count a test chooses: ``make("mirrored_cpu", n=4)``.
FAMILIES: dict[str, Callable[..., Any]] = {
    "one_device": one_device,
    "mirrored_cpu": mirrored_cpu,
    "central_storage_cpu": central_storage_cpu,
    "fully_sharded_cpu": fully_sharded_cpu,
    "multi_worker": multi_worker,
    "parameter_server": parameter_server,
}

#: The synchronous CPU configurations every behaviour test should pass under (the design's list).
SYNCHRONOUS = ("one_device", "mirrored_cpu_2", "central_storage_cpu_2", "multi_worker_2")


def make(name: str, n: int | None = None, **options: Any) -> Any:
    """Builds the strategy ``name``: a combination, or a family with ``n`` replicas.

    Raises:
        KeyError: no combination or family of that name.
    """
    if name in COMBINATIONS and n is None and not options:
        return COMBINATIONS[name].make()
    if name in FAMILIES:
        return FAMILIES[name](n if n is not None else 2, **options)
    raise KeyError(f"no strategy configuration {name!r}; known: {sorted(COMBINATIONS) + sorted(FAMILIES)}")
