"""Pieces the synchronous strategies share: timeouts, CPU threads, building the communicator."""

from __future__ import annotations

import atexit
import os
import weakref
from typing import Any

import torch

from phalanx.cluster.placement import own_address_for
from phalanx.comm.communicator import GlooCommunicator, GroupSpec, LocalCommunicator
from phalanx.devices import LogicalDevice, canonicalize, default_devices
from phalanx.errors import ClusterSpecError, InvalidDeviceError
from phalanx.launch.env import ReplicaEnv, install_error_recorder

DEFAULT_TIMEOUT = 300.0  # seconds for one collective; CommunicationOptions(timeout_seconds=...) overrides
DEFAULT_RENDEZVOUS_TIMEOUT = 120.0


def env_seconds(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ClusterSpecError(name, raw, "must be a number of seconds") from None
    if value <= 0:
        raise ClusterSpecError(name, raw, "must be positive")
    return value


def configure_cpu_threads(comm: Any, device_type: str) -> None:
    """Gives each CPU replica its share of the cores, unless the user chose (OMP_NUM_THREADS).

    Counts every process of the job on this host (after rendezvous), so two TF_CONFIG workers
    started separately on one machine do not each claim all of its cores.
    """
    if device_type != "cpu" or "OMP_NUM_THREADS" in os.environ or comm.world_size == 1:
        return
    here = comm.host_of(comm.rank)
    on_this_host = sum(1 for r in range(comm.world_size) if comm.host_of(r) == here)
    if on_this_host > 1:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // on_this_host))


def select_device(device: LogicalDevice) -> None:
    """Makes the replica's GPU the current CUDA device (Keras and torch create tensors there)."""
    if device.type == "cuda":
        torch.cuda.set_device(device.index)


def build_communicator(env: ReplicaEnv | None, *, timeout: float | None = None, bind_addr: str | None = None,
                       names: tuple[str, ...] = (), fingerprint: tuple[tuple[str, Any], ...] = (),
                       backend: str = "gloo") -> Any:
    """The communicator of this process: local for one replica, gloo/NCCL otherwise."""
    install_error_recorder()
    if env is None or env.world_size == 1:
        return LocalCommunicator()
    spec = GroupSpec(
        rank=env.rank, world_size=env.world_size, master_addr=env.master_addr, master_port=env.master_port,
        # With no address from a cluster spec, listen on the local address that routes to the master
        # (loopback for a single host): never on all interfaces, never on an address peers cannot reach.
        bind_addr=bind_addr or own_address_for(env.master_addr), names=names,
        timeout=timeout or env_seconds("PHALANX_COLLECTIVE_TIMEOUT", DEFAULT_TIMEOUT),
        rendezvous_timeout=env_seconds("PHALANX_RENDEZVOUS_TIMEOUT", DEFAULT_RENDEZVOUS_TIMEOUT),
        fingerprint=fingerprint)
    return GlooCommunicator(spec, backend=backend)


def close_at_exit(strategy: Any) -> None:
    """Closes the strategy's communicator when the interpreter exits, if nobody did before."""
    ref = weakref.ref(strategy)

    def _close() -> None:
        s = ref()
        if s is not None:
            s.close()

    atexit.register(_close)


def local_devices(devices: Any, env: ReplicaEnv | None, what: str = "devices") -> list[LogicalDevice]:
    """The replicas' devices on this host: as given, else one per process the launcher started,
    else every visible GPU or the CPU."""
    if devices is None:
        if env is None:
            return default_devices()
        kind = "cuda" if torch.cuda.device_count() >= env.local_world_size else "cpu"
        return [LogicalDevice(kind, i) for i in range(env.local_world_size)]
    if isinstance(devices, (str, torch.device)):
        devices = [devices]
    parsed = [canonicalize(d) for d in devices]
    if not parsed:
        raise InvalidDeviceError(devices, hint=f"give at least one device in `{what}`, e.g. ['cpu:0', 'cpu:1']")
    if len(set(parsed)) != len(parsed):
        raise InvalidDeviceError(list(devices), hint=f"each device may appear once in `{what}`")
    return parsed


def replica_env_for(strategy: Any, devices: list[LogicalDevice], what: str = "devices") -> ReplicaEnv | None:
    """This process's identity: from the launcher, or by starting the other replicas now."""
    from phalanx import interactive

    in_session = interactive.hooks.session is not None
    env = None if in_session else ReplicaEnv.from_environ()
    if env is None and len(devices) > 1:
        if in_session or interactive.interactive_main():  # a notebook, the REPL, -c, stdin: no script to rerun
            from phalanx.interactive.session import start

            strategy._launcher, env = start(strategy, len(devices))
        else:
            from phalanx.launch.self_launch import ReplicaLauncher

            strategy._launcher = ReplicaLauncher(len(devices))
            env = strategy._launcher.env
    if env is not None and env.local_world_size != len(devices):
        raise ClusterSpecError(what, [str(d) for d in devices],
                               f"the launcher started {env.local_world_size} replica processes on this host",
                               hint="pass as many devices as `phalanx run -n` starts, or none")
    return env
