"""A communicator's failures: typed errors naming the peer, the job's diagnosis, the chief's wait.

:class:`PeerFailures` is the collaborator a
:class:`~phalanx.comm.group_communicator.ProcessGroupCommunicator` holds (``comm.failures``) for
what it does when a collective goes wrong, or may go wrong for a long time:

* it translates a transport failure into a typed error naming the peer that caused it
  (:meth:`PeerFailures.errors_for`; the peers are found by
  :func:`phalanx.comm.health.unresponsive_peers`);
* when a collective fails, it asks every replica where it is and puts the answers side by side
  (:meth:`PeerFailures.diagnose`, :mod:`~phalanx.comm.diagnosis`), once, and rewrites the error
  from the diagnosis (:meth:`PeerFailures.explain`);
* it answers this replica's snapshot when asked (:meth:`PeerFailures.take_snapshot`, through the
  heartbeat thread's :class:`~phalanx.comm.snapshot.Agent`);
* it bounds the wait for chief-only work by the chief's liveness, not by the collective timeout
  (:meth:`PeerFailures.wait_for_chief`).

The communicator forwards its public ``errors_for``, ``diagnose``, ``explain`` and
``wait_for_chief`` here; the collectives themselves stay in the communicator.
"""

from __future__ import annotations

import contextlib
import datetime
import sys
import time
from collections.abc import Iterator
from typing import Any, Protocol

import torch.distributed as dist

from phalanx.comm import diagnosis, health, rendezvous, snapshot
from phalanx.comm.communicator import GroupSpec, classify
from phalanx.comm.flight_recorder import FlightRecorder
from phalanx.errors import CollectiveTimeoutError, DistributedRuntimeError, PeerUnavailableError, PhalanxError

__all__ = ["DIAGNOSIS_WAIT", "PeerFailures"]

# How long the replica whose collective failed waits for its peers' snapshots before it raises: an
# agent answers at its next heartbeat (0.25 s), after measuring its CPU share (0.1 s) when it is
# in its own code. A peer that has not answered by then is named silent.
DIAGNOSIS_WAIT = 2.0


class Owner(Protocol):
    """What :class:`PeerFailures` reads from its communicator (a ``ProcessGroupCommunicator``)."""

    spec: GroupSpec
    rank: int
    world_size: int
    recorder: FlightRecorder
    step: int | None  # the step under way, for the errors' messages


class PeerFailures:
    """What a :class:`~phalanx.comm.group_communicator.ProcessGroupCommunicator` does about failures.

    Args:
        comm: the communicator (its ``spec``, ``rank``, ``world_size``, ``recorder`` and current
            ``step`` are read from it).
        heartbeat_interval: the job's heartbeat interval (a peer silent for 4 of them is unresponsive).

    The job's store and the peers' records (host, pid) are known after the rendezvous; the
    communicator hands them over with :meth:`joined`. Before that, an error names no peer.
    """

    def __init__(self, comm: Owner, heartbeat_interval: float) -> None:
        self._comm = comm
        self.spec = comm.spec
        self.rank, self.world_size = comm.rank, comm.world_size
        self.recorder = comm.recorder
        self._heartbeat_interval = heartbeat_interval
        self.peers: dict[int, dict[str, Any]] | None = None
        self.store: Any = None
        self._explained = False  # one diagnosis per communicator: the first failure is the one to explain
        self._waiting_for_chief: dict[str, Any] | None = None
        self._chief_calls = 0

    def joined(self, store: Any, peers: dict[int, dict[str, Any]]) -> None:
        """The job's store (under this strategy's prefix) and the peers found at the rendezvous."""
        self.store, self.peers = store, peers

    def unresponsive_peers(self) -> list[int]:
        """Ranks that are dead or stopped (see :func:`phalanx.comm.health.unresponsive_peers`)."""
        return health.unresponsive_peers(
            self.peers,
            self.rank,
            rendezvous.host_id(),
            (self.spec.master_addr, self.spec.master_port),
            self.world_size,
            self._heartbeat_interval,
            prefix=rendezvous.joined_prefix(self.spec.master_addr, self.spec.master_port) + self.spec.store_prefix,
        )

    @contextlib.contextmanager
    def errors_for(self, operation: str, slot: int | None = None) -> Iterator[None]:
        """Translates a transport failure inside the block into a typed error naming the peer.

        The kind (:func:`classify`): a timeout (:class:`~phalanx.errors.CollectiveTimeoutError`)
        or a lost peer (:class:`~phalanx.errors.PeerUnavailableError`); the peers are found by
        :func:`phalanx.comm.health.unresponsive_peers`. With the flight recorder's ``slot`` of the
        collective, the failure is diagnosed (:meth:`explain`) before it is raised.
        """
        try:
            yield
        except RuntimeError as e:  # DistBackendError, DistNetworkError, DistStoreError, ...
            if isinstance(e, PhalanxError):  # already typed (shared memory, the guard): keep it
                raise
            text = str(e)
            peers = [self.spec.name(r) for r in self.unresponsive_peers()] if self.peers is not None else []
            first_line = text.strip().splitlines()[0] if text.strip() else type(e).__name__
            error = classify(e)(
                peers,
                step=self._comm.step,
                operation=f"{operation} on {self.spec.name(self.rank)}",
                cause=first_line[:300],
            )
            if slot is not None:
                self.recorder.failed(slot, error)
                error = self.explain(error)
            raise error from e

    # ----------------------------------------------------------------------------- diagnosis
    def take_snapshot(self, request: int | str | None = None, sample_cpu: bool | None = None) -> dict[str, Any]:
        """This replica's snapshot (:func:`phalanx.comm.snapshot.take`); its CPU share is measured
        only where its main thread is in its own code (in a collective it is phalanx's)."""
        if sample_cpu is None:
            sample_cpu = self.recorder.current() is None
        waiting = self._waiting_for_chief
        if waiting is not None:
            waiting = {**waiting, "seconds": time.monotonic() - waiting["since"]}
        return snapshot.take(
            rank=self.rank,
            world_size=self.world_size,
            name=self.spec.name(self.rank),
            recorder=self.recorder,
            step=self._comm.step,
            timeout=self.spec.timeout,
            host=str(self.peers[self.rank]["host"]) if self.peers is not None else "",
            request=request,
            sample_cpu=sample_cpu,
            waiting_for_chief=waiting,
        )

    def _short_store(self) -> Any:
        """A fresh client of the job's store that gives up within 2 s (the shared one waits for
        minutes, and its server lives in rank 0's process, which may be the one stopped)."""
        client = dist.TCPStore(
            self.spec.master_addr,
            self.spec.master_port,
            self.world_size,
            False,
            datetime.timedelta(seconds=2),
            wait_for_workers=False,
        )
        prefix = rendezvous.joined_prefix(self.spec.master_addr, self.spec.master_port) + self.spec.store_prefix
        return dist.PrefixStore(prefix, client) if prefix else client

    def diagnose(self, *, trigger: dict[str, Any] | None = None, live: bool = False) -> dict[str, Any]:
        """Asks every replica where it is (through the job's store) and puts the answers side by side.

        Returns:
            The diagnosis (:func:`phalanx.comm.diagnosis.analyse`): where each replica is, where
            their collectives part, and the cause.
        """
        own = self.take_snapshot(sample_cpu=False)
        absent: dict[int, str] = {}
        here = str(self.peers[self.rank]["host"])
        ended: dict[int, dict[str, Any]] = {}
        for r, info in self.peers.items():
            if r != self.rank and str(info["host"]) == here:
                state = health.process_state(int(info["pid"]))
                if state in ("", "Z", "X"):
                    final = snapshot.final(self.spec.run_dir, r, int(info["pid"])) if self.spec.run_dir else None
                    if final is not None:  # it closed its strategy first: its program has ended
                        ended[r] = final
                    else:
                        absent[r] = f"dead: its process ({info['pid']}) has exited"
                elif state in ("T", "t"):
                    absent[r] = f"stopped (SIGSTOP or a debugger), pid {info['pid']}"
        ask = [r for r in range(self.world_size) if r != self.rank and r not in absent and r not in ended]
        found: dict[int, dict[str, Any]] = {}
        if ask:
            try:
                found = snapshot.ask(self._short_store(), ask, DIAGNOSIS_WAIT)
            except Exception:  # noqa: BLE001 - the store is gone (rank 0 died): say what is known here
                found = {}
        found.update(ended)
        found[self.rank] = own
        return diagnosis.analyse(
            found,
            self.world_size,
            absent=absent,
            names={r: self.spec.name(r) for r in range(self.world_size)},
            trigger=trigger,
            timeout=self.spec.timeout,
            live=live,
        )

    @contextlib.contextmanager
    def wait_for_chief(self, what: str = "chief-only work") -> Iterator[None]:
        """Work that the chief (rank 0) does alone inside the block; the others wait at its end.

        Every rank enters the block (at the same point of the program); rank 0 runs the work, the
        others run nothing and then wait for it for as long as rank 0 is alive, however long that
        is: not ``PHALANX_COLLECTIVE_TIMEOUT``, which bounds each collective. Rank 0 declares the
        work meanwhile (a diagnosis shows it busy, not stuck). A rank 0 that dies ends the wait at
        once with :class:`~phalanx.errors.PeerUnavailableError`; one that is stopped (SIGSTOP, a
        debugger) or whose heartbeat stops for longer than the collective timeout, with
        :class:`~phalanx.errors.CollectiveTimeoutError`.
        """
        self._chief_calls += 1
        key = f"chief/done/{self._chief_calls}"
        if self.rank == 0:
            self.recorder.busy = {"what": what, "since": time.time()}
            try:
                yield
            finally:
                self.recorder.busy = None
                self.store.set(key, "1")  # also after an error the chief caught: the others go on
            return
        yield
        self._await_chief(key, what)

    def _await_chief(self, key: str, what: str) -> None:
        """Waits until rank 0 sets ``key``, bounded by rank 0's liveness (see :meth:`wait_for_chief`)."""
        me, chief = self.spec.name(self.rank), self.spec.name(0)
        operation = f"waiting for the chief's {what} on {me}"
        info = self.peers[0]
        local = str(info["host"]) == str(self.peers[self.rank]["host"])
        start = last_sign = time.monotonic()
        last_beat: Any = None
        self._waiting_for_chief = {"what": what, "since": start}
        try:
            while True:
                try:
                    if self.store.check([key]):
                        return
                    beat = self.store.get("hb/0") if not local and self.store.check(["hb/0"]) else None
                except RuntimeError as e:  # the store lives in rank 0's process: it is gone
                    raise PeerUnavailableError(
                        [chief], step=self._comm.step, operation=operation, cause=f"its store stopped answering ({e})"
                    ) from e
                now = time.monotonic()
                if local:
                    state = health.process_state(int(info["pid"]))
                    if state in ("", "Z", "X"):
                        raise PeerUnavailableError(
                            [chief],
                            step=self._comm.step,
                            operation=operation,
                            cause=f"its process ({info['pid']}) exited",
                        )
                    if state not in ("T", "t"):
                        last_sign = now
                elif beat != last_beat:
                    last_beat, last_sign = beat, now
                if now - last_sign > self.spec.timeout:
                    raise CollectiveTimeoutError(
                        [chief],
                        step=self._comm.step,
                        operation=operation,
                        cause=f"stopped, or its heartbeat silent, for {self.spec.timeout:g}s",
                        hint="a stopped chief (SIGSTOP, a debugger) holds the job; PHALANX_COLLECTIVE_TIMEOUT bounds "
                        "how long the others wait for a chief that shows no sign of life",
                    )
                time.sleep(0.05)
        finally:
            self._waiting_for_chief = None

    def explain(self, error: BaseException) -> BaseException:
        """The error to raise for a failed collective: ``error`` with the job's diagnosis.

        The first time only (the first failure is the one that matters; a diagnosis takes up to
        :data:`DIAGNOSIS_WAIT` seconds): asks every replica where it is, writes the diagnosis to the
        run directory, if any, for the launcher to print (or, where no launcher prints it: a
        ``TF_CONFIG`` job started by hand, a notebook, prints it on this process's stderr), and
        returns a typed error that names the replica that caused the failure
        and its line. A timeout or a lost peer becomes an error of the same class naming the cause;
        any other error keeps its class and gains the diagnosis in its message. Never raises.
        """
        if (
            self._explained
            or not self.spec.explain_failures  # an elastic job re-forms its group instead
            or not isinstance(error, DistributedRuntimeError)
            or self.peers is None
        ):
            return error
        self._explained = True
        trigger = {"rank": self.rank, "name": self.spec.name(self.rank), "error": type(error).__name__}
        marked = diagnosis.diagnosing(self.spec.run_dir, self.rank) if self.spec.run_dir else contextlib.nullcontext()
        kept = ""
        with marked:  # the launcher does not stop this replica before the diagnosis is written
            try:
                found = self.diagnose(trigger=trigger)
            except Exception:  # noqa: BLE001 - a diagnosis never hides the error it explains
                return error
            if self.spec.run_dir:
                try:
                    kept = diagnosis.write(
                        found, self.spec.run_dir, keep_within=self.spec.timeout + DIAGNOSIS_WAIT + 10
                    )
                except OSError:
                    kept = ""
        if not (kept and self.spec.launcher_prints):
            with contextlib.suppress(Exception):  # a closed or broken stderr never hides the error
                sys.stderr.write("phalanx: " + diagnosis.render(found, where=kept or None) + "\n")
                sys.stderr.flush()
        return with_diagnosis(error, found, self.spec.name(self.rank))


def with_diagnosis(error: BaseException, found: dict[str, Any], me: str) -> BaseException:
    """``error`` rewritten from a diagnosis: the cause named, its line, and the diagnosis' hint.

    A timeout or a lost peer (:class:`~phalanx.errors.PeerUnavailableError`) becomes an error of the
    same class naming the replicas that caused it (the launcher's report reads them from the
    message too); any other error keeps its class and instance, with the diagnosis appended.
    """
    culprits = found.get("culprits") or []
    names = {e["rank"]: e["name"] for e in found.get("replicas") or []}
    parting = found.get("parting")
    if isinstance(error, PeerUnavailableError):
        if parting is not None:
            named = [names[r] for r in culprits if names.get(r) != me] or list(error.peers)
            cause = f"the replicas' collectives part at #{parting['seq']}, {parting['verdict']}: {parting['text']}; "
            cause += "; ".join(parting.get("calls") or [])
        elif culprits:
            named = [names[r] for r in culprits]
            where = {e["rank"]: e["where"] for e in found.get("replicas") or []}
            cause = "; ".join(f"{names[r]} is {where[r]}" for r in culprits)
            if isinstance(error, CollectiveTimeoutError) and found.get("timeout"):
                cause += f"; it did not arrive within {found['timeout']:g}s"
            else:
                cause += f"; {error.cause}"
        else:
            named, cause = list(error.peers), f"{error.cause}; {found.get('summary')}"
        new = type(error)(
            named, step=error.step, operation=error.operation, cause=cause[:2000], hint=found.get("hint") or None
        )
        new.diagnosis = found
        return new
    if parting is not None:
        text = f"{error.args[0].split(' HINT: ')[0]} The replicas' collectives part at #{parting['seq']}, "
        text += f"{parting['verdict']}: {parting['text']} ({'; '.join(parting.get('calls') or [])})."
        error.args = (f"{text} HINT: {parting['hint']}",)
        if hasattr(error, "hint"):
            error.hint = parting["hint"]
    error.diagnosis = found  # type: ignore[attr-defined]
    return error
