"""ParameterServerStrategy: asynchronous training with variables on parameter servers (TF 2's).

A cluster has one ``chief`` (the coordinator: it runs the user's program), ``worker`` tasks (they
run the functions the coordinator schedules) and ``ps`` tasks (they hold the variables and apply
the updates). Every task runs the same script. Constructing the strategy in a ``ps`` or ``worker``
task turns that process into a server: it serves until the coordinator shuts the cluster down,
then **exits the process** (exit code 0, after running ``atexit`` handlers). So the script's body
after the strategy line runs on the chief only, as TF scripts have non-chief tasks call
``server.join()``. A program that wants control back on its servers passes ``serve_and_exit=False``
and calls :meth:`ParameterServerStrategy.serve` (or :func:`phalanx.ps.serve`), which returns when
the cluster shuts down::

    strategy = phalanx.ParameterServerStrategy()   # from TF_CONFIG, or `phalanx run --ps 2 --workers 3`
    # ---- only the chief gets here ----
    coordinator = phalanx.coordinator.ClusterCoordinator(strategy)
    with strategy.scope():
        model = Net()                               # its parameters and buffers go to the PS
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)

Variables. Parameters and buffers registered in ``scope()`` on the chief are created on the
parameter servers, round robin, with their initial values; a ``variable_partitioner`` splits large
ones along dimension 0 into shards on several servers (:class:`~phalanx.ps.remote_variables.ShardedVariable`).
The chief's module keeps ordinary tensors, a local copy:

* ``coordinator.join()`` (and :meth:`ParameterServerExtended.pull_variables`) refreshes it
  from the servers, for evaluation or saving;
* writes to it (``load_state_dict`` after restoring a checkpoint, in-place updates) are sent to
  the servers before the next ``schedule`` (:meth:`ParameterServerExtended.push_variables`),
  detected with torch's tensor version counter. Writes through ``.data`` are not seen: call
  ``push_variables(force=True)`` after them.

Optimizer. Create it on the chief over the model's parameters, in or after ``scope()``; a
scheduled function calls ``optimizer.step()`` as usual. On the worker that step sends the
gradients to the servers, which apply them with an optimizer of the same ``torch.optim`` class and
hyperparameters; optimizer state (momentum, Adam moments) lives on the server next to its
variable (:mod:`phalanx.ps.worker`, :mod:`phalanx.ps.variable_server`).

Security. Code goes from the coordinator to the workers pickled, so every message is signed with
the cluster's shared secret (``PHALANX_CLUSTER_SECRET``; ``phalanx run --ps`` makes one) and
nothing unsigned is unpickled; parameter servers unpickle nothing at all. Servers listen on their
own address from the cluster spec.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from phalanx import config
from phalanx._compat.python import run_exit_handlers
from phalanx.cluster import ClusterResolver, resolve_from_environment
from phalanx.cluster.validation import validate_cluster
from phalanx.comm.communicator import LocalCommunicator
from phalanx.core.extended import StrategyExtended
from phalanx.core.strategy import Strategy, close_at_exit
from phalanx.devices import LogicalDevice
from phalanx.errors import ClusterSpecError, ContextError
from phalanx.launch import replica_hooks
from phalanx.ps import pickling, wire
from phalanx.ps.client import RemoteTask, call_all
from phalanx.ps.cluster_connection import ClusterConnection
from phalanx.ps.errors import task_device
from phalanx.ps.remote_variables import RemoteVariable, ShardedVariable, ShardIO
from phalanx.ps.server_variables import ServerVariables

log = logging.getLogger("phalanx.ps")


class ParameterServerExtended(StrategyExtended):
    """The machinery of :class:`ParameterServerStrategy` (variables, servers, the chief's copies)."""

    def __init__(
        self,
        *,
        role: str,
        task_id: int,
        cluster: Any,
        secret: bytes,
        transport: Any,
        rpc_timeout: float,
        partitioner: Callable[..., Sequence[int]] | None,
    ) -> None:
        self._role, self._task_id = role, task_id
        self._task_name = f"{role}:{task_id}"
        self._cluster = cluster
        self._secret = secret
        self._transport = transport
        self._rpc_timeout = rpc_timeout
        self._heartbeat = min(1.0, max(0.1, rpc_timeout / 4))
        self._worker_recovery_timeout = config.settings().worker_recovery_timeout
        self._partitioner = partitioner
        ps_indices = cluster.task_indices("ps")
        # The coordinator's client: connections to the parameter servers and workers (cluster_connection.py).
        self.cluster = ClusterConnection(role, self._task_name, cluster, transport, secret, rpc_timeout)
        self._io = ShardIO(self.cluster.ps_tasks)
        workers = tuple(f"{task_device('worker', i)}/device:CPU:0" for i in cluster.task_indices("worker"))
        parameters = tuple(f"{task_device('ps', i)}/device:CPU:0" for i in ps_indices)
        super().__init__(LocalCommunicator(), LogicalDevice("cpu", 0), workers, parameters)
        # Variable placement on the servers and the chief's copies (server_variables.py).
        self.server_variables = ServerVariables(
            self._io, len(self.cluster.ps_tasks), partitioner, self.variable_sync.mark_owned
        )
        self._coordinator: Any = None

    # ---------------------------------------------------------------- TF's properties
    @property
    def should_checkpoint(self) -> bool:
        return self._role == "chief"

    @property
    def should_save_summary(self) -> bool:
        return self._role == "chief"

    @property
    def experimental_between_graph(self) -> bool:
        return True

    # ---------------------------------------------------------------- the contract with the coordinator
    @property
    def is_asynchronous(self) -> bool:
        """True: each worker trains on its own batches; the servers apply updates as they come."""
        return True

    @property
    def rpc_timeout(self) -> float:
        """Seconds before a call to a task counts as failed."""
        return self._rpc_timeout

    def leave_cluster_running(self) -> None:
        """Closing this chief will not shut the cluster down (another coordinator takes over)."""
        self.cluster.stopped = True

    @property
    def shard_io(self) -> ShardIO:
        """Reads and writes of the variables' shards on the parameter servers."""
        return self._io

    @property
    def role(self) -> str:
        """This task's job: ``chief``, ``worker`` or ``ps``."""
        return self._role

    @property
    def task_name(self) -> str:
        """This task, as ``job:index``."""
        return self._task_name

    @property
    def heartbeat_interval(self) -> float:
        """Seconds between the coordinator's liveness checks of a task."""
        return self._heartbeat

    @property
    def worker_recovery_timeout(self) -> float:
        """Seconds the coordinator waits for any worker to come back before failing."""
        return self._worker_recovery_timeout

    @property
    def coordinator(self) -> Any:
        """The :class:`~phalanx.coordinator.ClusterCoordinator` attached to this strategy, if any."""
        return self._coordinator

    @coordinator.setter
    def coordinator(self, value: Any) -> None:
        self._coordinator = value

    def parameter_servers(self) -> list[tuple[RemoteTask, str | None]]:
        """Each parameter server and the incarnation it had when the chief connected."""
        return list(zip(self.cluster.ps_tasks, self.cluster.ps_incarnations))

    def connect_workers(self) -> list[RemoteTask]:
        """Connections to every worker (made once)."""
        return self.cluster.workers()

    def stop_cluster(self, timeout: float = 5.0) -> None:
        """Tells every worker and parameter server to exit (best effort, bounded by ``timeout``)."""
        self.cluster.stop(timeout)

    def persistent_id(self, obj: Any) -> Any:
        """The reference a scheduled function carries for ``obj`` instead of a pickled copy, or None."""
        if isinstance(obj, torch.Tensor):
            return self.server_variables.reference(obj)
        ref = pickling.reference_to(obj, self)  # objects of integrations (a Keras model built in scope)
        if ref is not None:
            return ref
        if isinstance(obj, Strategy):
            if obj.extended is self:
                return ("strategy",)
            raise TypeError(f"a scheduled function refers to another strategy ({obj!r}); it cannot run on a worker")
        if obj is self:
            return ("extended",)
        return None

    def _close(self) -> None:
        self.cluster.close()
        if self._coordinator is not None:
            self._coordinator.shutdown()
        self.cluster.stop()

    # ---------------------------------------------------------------- variables (server_variables.py)
    def _sync_new_variables(self) -> None:
        params, buffers = self.variable_sync.take_new()
        if self._role != "chief" or not (params or buffers):
            return  # variables made inside a scheduled function stay local to its worker
        self.server_variables.create(params, buffers)

    @property
    def variables(self) -> list[RemoteVariable | ShardedVariable]:
        """Handles to every variable on the parameter servers, in creation order."""
        return self.server_variables.handles

    def remote_variable(self, tensor: torch.Tensor) -> RemoteVariable | ShardedVariable:
        """The handle of the variable behind one of the chief's parameters or buffers.

        Raises:
            KeyError: ``tensor`` was not created in this strategy's scope.
        """
        return self.server_variables.remote_variable(tensor)

    def pull_variables(self, names: Sequence[str] | None = None) -> None:
        """Copies the servers' current values into the chief's tensors (after sending the chief's own changes)."""
        if self._role == "chief":
            self.server_variables.pull(names)

    def push_variables(self, force: bool = False) -> None:
        """Sends the chief's tensors that changed since they were last synchronised (all with ``force``)."""
        if self._role == "chief":
            self.server_variables.push(force)

    def variable_json(self, tensor: Any) -> str | None:
        """The wire description of the variable behind ``tensor`` (a chief's tensor), or None if it is not one."""
        return self.server_variables.variable_json(tensor)

    # Checkpoints: optimizer state lives on the servers (see ServerVariables.state_to_save).
    def state_to_save(self, obj: Any) -> Any:
        return self.server_variables.state_to_save(obj) if self._role == "chief" else None

    def after_restore(self, obj: Any) -> None:
        if self._role == "chief":
            self.server_variables.after_restore(obj)

    def parameter_server_stats(self) -> list[dict[str, Any]]:
        """What each parameter server reports: its pid, number of variables and of applied updates."""
        return [reply.header for reply in call_all([(t, "ping", {}, []) for t in self.cluster.ps_tasks])]

    # ---------------------------------------------------------------- serving (ps and worker tasks)
    def serve(self, strategy: ParameterServerStrategy) -> int:
        """Serves this task's operations until the coordinator shuts the cluster down (0) or the
        chief is not heard from for ``PHALANX_ORPHAN_TIMEOUT`` seconds (3)."""
        from phalanx.ps.variable_server import ParameterServerService
        from phalanx.ps.worker import WorkerService

        stop = threading.Event()
        address = self._cluster.task_address(self._role, self._task_id)
        # The first torch.optim optimizer of a process imports ~800 modules (about 1.5 s, more on a
        # busy host): pay that before answering, not inside the first update's RPC deadline.
        torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.0)
        if self._role == "ps":
            service: Any = ParameterServerService(self._task_id, self._secret, on_shutdown=stop.set)
        else:
            service = WorkerService(
                self._task_id,
                len(self._cluster.task_indices("worker")),
                strategy,
                self._io,
                self._secret,
                on_shutdown=stop.set,
            )
        server = self._transport.serve(address, service)
        orphan = config.settings().orphan_timeout
        log.info("phalanx %s: serving on %s (pid %d)", self._task_name, address, os.getpid())
        print(f"phalanx {self._task_name}: serving on {address}", file=sys.stderr, flush=True)
        code = 0
        while not stop.wait(0.2):
            if service.orphaned(orphan):  # counted from this server's start: a chief that never came counts
                from phalanx.ps.errors import OrphanedError

                print(
                    f"phalanx: {OrphanedError(self._task_name, orphan, service.last_chief_contact > 0)}",
                    file=sys.stderr,
                    flush=True,
                )
                code = 3
                break
        service.refusals.flush()
        server.stop(grace=1.0)
        return code


def _resolve(cluster_resolver: ClusterResolver | None) -> tuple[ClusterResolver, Any, str, int]:
    resolver = cluster_resolver if cluster_resolver is not None else resolve_from_environment()
    spec = resolver.cluster_spec() if resolver is not None else None
    if not spec:
        raise ClusterSpecError(
            "cluster",
            None,
            "ParameterServerStrategy needs a cluster with 'ps' and 'worker' tasks",
            hint="set TF_CONFIG in every task, or start the cluster locally with "
            "`phalanx run --ps 2 --workers 3 train.py`",
        )
    cluster = validate_cluster(spec, resolver.task_type, resolver.task_id, require_ps=True)
    if resolver.task_type not in ("chief", "ps", "worker"):
        raise ClusterSpecError(
            "task.type",
            resolver.task_type,
            "ParameterServerStrategy runs on 'chief' (the coordinator), 'worker' and 'ps' tasks",
            hint="side-car evaluation is not supported; evaluate on the chief after join()",
        )
    if resolver.task_type == "chief" and "chief" not in cluster.jobs:
        raise ClusterSpecError("cluster.chief", None, "the coordinator must be the cluster's 'chief' task")
    return resolver, cluster, resolver.task_type, int(resolver.task_id)


class ParameterServerStrategy(Strategy):
    """Asynchronous data parallelism with variables on parameter servers (``tf.distribute.ParameterServerStrategy``).

    Args:
        cluster_resolver: who is who (``chief``, ``worker`` x N, ``ps`` x M); default: from the
            environment (``TF_CONFIG``; ``phalanx run --ps M --workers N`` sets it).
        variable_partitioner: splits a variable along dimension 0, e.g.
            ``phalanx.experimental.partitioners.MinSizePartitioner(min_shard_bytes=256 << 10, max_shards=2)``;
            None: every variable whole on one server.
        rpc_timeout: seconds before a call to a server counts as failed (default 30, or
            ``PHALANX_RPC_TIMEOUT``). A parameter server failure is reported within it plus ~1 s.
        cluster_secret: the shared secret (default ``PHALANX_CLUSTER_SECRET``).
        transport: how tasks talk (default gRPC); tests pass an in-process one.

        serve_and_exit: in a ``ps`` or ``worker`` task, serve in the constructor until the
            coordinator shuts the cluster down and then exit the process (the default, so the
            script's body after the strategy line runs on the chief only); False: return, and
            serve with :meth:`serve` (or use :func:`phalanx.ps.serve`), which returns when the
            cluster shuts down, as TF's ``Server.join()`` does.

    Raises:
        ClusterSpecError: no cluster, no ``ps`` or ``worker`` job, a malformed spec, or this task
            cannot listen on its address.
        ClusterSecretError: no shared secret is set.
        RendezvousTimeoutError: (chief) a parameter server did not answer within
            ``PHALANX_RENDEZVOUS_TIMEOUT`` (120 s).
    """

    def __init__(
        self,
        cluster_resolver: ClusterResolver | None = None,
        variable_partitioner: Callable[..., Sequence[int]] | None = None,
        *,
        rpc_timeout: float | None = None,
        cluster_secret: str | bytes | None = None,
        transport: Any = None,
        serve_and_exit: bool = True,
    ) -> None:
        # Under `phalanx run --ps`: the error file, the stack dump (PHALANX_STACK_SIGNAL), the parent watch and
        # the mark that the program finished (a task still running after the chief's end fails the job).
        replica_hooks.install()
        self._build(cluster_resolver, variable_partitioner, rpc_timeout, cluster_secret, transport)
        extended = self._extended
        if extended.role in ("ps", "worker"):
            if serve_and_exit:
                _exit_server(self.serve())
            return
        settings = config.settings()
        extended.cluster.wait_for_parameter_servers(settings.rendezvous_timeout, settings.rendezvous_notice)
        extended.cluster.start_keepalive()
        close_at_exit(self)

    def serve(self) -> int:
        """Serves this ``ps`` or ``worker`` task's operations until the coordinator shuts the cluster down.

        Returns then, with 0; or with 3 once nothing authenticated came from the chief for
        ``PHALANX_ORPHAN_TIMEOUT`` seconds, counted from the start of serving.

        Raises:
            ContextError: called on the chief, which coordinates rather than serves.
        """
        if self._extended.role == "chief":
            raise ContextError(
                "ParameterServerStrategy.serve was called on the chief.",
                hint="only 'ps' and 'worker' tasks serve; the chief schedules functions",
            )
        return self._extended.serve(self)

    def _build(
        self,
        cluster_resolver: ClusterResolver | None,
        variable_partitioner: Any,
        rpc_timeout: float | None,
        cluster_secret: str | bytes | None,
        transport: Any,
    ) -> None:
        """Everything but serving or connecting (tests build in-process workers with it)."""
        resolver, cluster, role, task_id = _resolve(cluster_resolver)
        secret = wire.cluster_secret(cluster_secret)
        if transport is None:
            from phalanx.ps.transport import GrpcTransport

            transport = GrpcTransport()
        timeout = rpc_timeout if rpc_timeout is not None else config.settings().rpc_timeout
        if not timeout > 0:
            raise ValueError(f"rpc_timeout must be positive; received {rpc_timeout!r}")
        extended = ParameterServerExtended(
            role=role,
            task_id=task_id,
            cluster=cluster,
            secret=secret,
            transport=transport,
            rpc_timeout=timeout,
            partitioner=variable_partitioner,
        )
        super().__init__(extended, cluster_resolver=resolver)
        self._variable_partitioner = variable_partitioner

    def run(self, fn: Callable[..., Any], args: tuple = (), kwargs: dict | None = None, options: Any = None) -> Any:
        """Runs ``fn`` on this worker's replica: call it inside a function given to ``coordinator.schedule``.

        Raises:
            ContextError: called on the chief; there it would train the chief's copy alone.
        """
        if self._extended._role == "chief":
            raise ContextError(
                "ParameterServerStrategy.run was called on the chief, outside a scheduled function.",
                hint="wrap the step in a function and give it to ClusterCoordinator(strategy).schedule(fn, args); "
                "strategy.run may be called inside that function; Keras' model.fit schedules its steps itself",
            )
        return super().run(fn, args, kwargs, options)

    @property
    def num_replicas_in_sync(self) -> int:
        """1: each worker trains on its own batches (``tf``'s value on CPU workers)."""
        return 1

    @property
    def variable_partitioner(self) -> Any:
        return self._variable_partitioner

    def __repr__(self) -> str:
        ext = self._extended
        return (
            f"ParameterServerStrategy(task={ext._task_name!r}, ps={len(ext.cluster.ps_tasks)}, "
            f"workers={len(ext.worker_devices)})"
        )


def _exit_server(code: int = 0) -> None:
    """Ends a ps/worker process once it has served: exit handlers run, then the process exits with ``code``.

    The interpreter's own teardown is skipped (``os._exit`` after ``atexit``): with torch loaded it
    takes seconds, and a scheduled function still running in a server thread would block it.
    """
    run_exit_handlers()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
