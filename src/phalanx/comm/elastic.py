"""An elastic synchronous job: it loses replicas and goes on with the rest, within a step.

``phalanx run -n 3 --min-nproc 2 train.py`` (or ``PHALANX_MIN_NPROC=2`` in every task of a
``TF_CONFIG`` job) makes each replica's communicator an :class:`ElasticCommunicator`: the same
collectives, over a group that can re-form without the replicas that died.

The model, in three rules (and a fourth for replacements, below):

* **One vote per step, before any update.** When the last gradient bucket of a backward pass has
  its sum, each replica adds its vote to a counter in the job's store; the step's update is
  applied only when every replica of the group voted (the last voter writes ``commit``, once, with
  ``compare_set``). A replica whose collective failed, or that finds a peer dead while it waits,
  writes ``abort`` instead; the first word written is the decision every replica reads. So every
  survivor applies the step's update, or none does: never half of them.
* **The survivors re-form the group.** After an abort (or a collective that failed after the
  vote), each survivor says in the store that it is here; once every member of the old group is
  here or dead (``/proc`` on its host, its heartbeat elsewhere), the first to see it writes the new
  membership, in the old order. A new process group is built among them (shared memory within a
  host, gloo across), ranks renumbered, the old one closed. Fewer than the minimum, survivors at
  different points of the step, or a replica left out: :class:`~phalanx.errors.ElasticRecoveryError`.
* **The step runs again.** :class:`~phalanx.errors.GroupChangedError` leaves the user's step;
  ``strategy.run`` catches it, gives each survivor its new share of the same global batch (the
  distributed dataset keeps it with the batch), and runs the step again. The global batch size
  stays what the program set: the optimisation is the same as before, only slower.

A collective that fails after the vote (a loss reduced after the update, say) is made again on
the re-formed group, from a copy of its input: its result then covers the survivors.

A replacement (``PHALANX_JOIN_AS``; ``phalanx run`` starts one after a loss) is alone until its
first step, where it asks to join (:meth:`ElasticCommunicator.join`); the :class:`Ballot`'s
watchdog counts the requests, the last voter writes the count into a step's decision, and every
member admits those counted at the next step boundary (:meth:`ElasticCommunicator.grow`), where
:mod:`phalanx.core.rejoin` sends them replica 0's state.

The job's store must outlive any replica: ``phalanx run`` serves it from a process of its own;
in a ``TF_CONFIG`` job the chief serves it (a job that loses its chief ends).

Example:
    >>> changes = []
    >>> remove = on_membership_change(changes.append)
    >>> remove()
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import json
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist

from phalanx._signal_routing import helper_threads_ignore_stop_signals
from phalanx.comm import rendezvous
from phalanx.comm.communicator import GroupSpec, Handle, LocalCommunicator
from phalanx.comm.group_communicator import ProcessGroupCommunicator
from phalanx.errors import (
    CollectiveTimeoutError,
    ElasticRecoveryError,
    GroupChangedError,
    PeerUnavailableError,
)

_COMMIT, _ABORT = b"commit", b"abort"
# How often a replica waiting for the vote or for the others to re-form looks for dead peers.
_LIVENESS_S = 0.05


@dataclass(frozen=True)
class MembershipChange:
    """What a change of an elastic job's group was, as callbacks are told.

    Attributes:
        step: the step during which it happened (run again on the new group).
        before, after: the replicas (their names in the job, in rank order) before and after.
        lost: those that left.
        seconds: how long the survivors took to re-form the group.
        joined: those that joined (replacements admitted at a step boundary).
    """

    step: int
    before: tuple[str, ...]
    after: tuple[str, ...]
    lost: tuple[str, ...]
    seconds: float
    joined: tuple[str, ...] = ()


_LISTENERS: list[Callable[[MembershipChange], None]] = []
_LOCK = threading.Lock()


def on_membership_change(callback: Callable[[MembershipChange], None]) -> Callable[[], None]:
    """Calls ``callback(change)`` on every replica after its group re-formed; returns its remover.

    Called between the abandoned attempt of a step and its new one, when
    ``strategy.num_replicas_in_sync`` already says the new size.
    """
    with _LOCK:
        _LISTENERS.append(callback)

    def remove() -> None:
        with _LOCK:
            if callback in _LISTENERS:
                _LISTENERS.remove(callback)

    return remove


def _differ(theirs: str, ours: str) -> str:
    """Where two replicas' digests (their program's hash, their variables' shapes and dtypes; see
    :func:`phalanx.core.rejoin.digest`) first differ, in words."""
    a, b = json.loads(theirs), json.loads(ours)
    if a["program"] != b["program"]:
        return f"its program differs from the group's ({a['program'][:12]}, the group's {b['program'][:12]})"
    a, b = a["variables"], b["variables"]
    if len(a) != len(b):
        return f"its model differs from the group's ({len(a)} variables, the group's {len(b)})"
    i = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
    return f"its model differs from the group's (variable {i}: {a[i]}, the group's {b[i]})"


def _misplaced(asked: str, at: str) -> str | None:
    """Why a replacement that joins at ``asked`` (``"step"``: a custom loop's first ``strategy.run``;
    ``"epoch"``: Keras ``fit``'s epoch boundary) cannot join a group now at ``at``; None if it can."""
    if asked == at:
        return None
    if asked == "epoch":
        return "it joins Keras fit at an epoch boundary, and the group's steps are not in fit"
    return "it joins at a step of a custom loop, and the group is in Keras fit (which takes one at an epoch boundary)"


def _connect(spec: GroupSpec) -> Any:
    """The job's store, connected as the process group's rendezvous would (or served, by rank 0)."""
    return rendezvous.connect_store(
        rank=spec.rank,
        world_size=spec.world_size,
        master_addr=spec.master_addr,
        master_port=spec.master_port,
        bind_addr=spec.bind_addr,
        timeout=spec.rendezvous_timeout,
        master_task=spec.name(0),
        task=spec.name(spec.rank),
    )


def _client(spec: GroupSpec) -> Any:
    """A second client of the job's store, under the same prefix as the first."""
    client = dist.TCPStore(
        spec.master_addr,
        spec.master_port,
        None,
        False,
        datetime.timedelta(seconds=spec.rendezvous_timeout),
        wait_for_workers=False,
    )
    prefix = rendezvous.joined_prefix(spec.master_addr, spec.master_port)
    return dist.PrefixStore(prefix, client) if prefix else client


class Ballot:
    """The store's side of an elastic group's votes, and the watchdog thread beside them.

    Args:
        control: the group's keys in the job's store.
        watch_control: the same keys through a second client: the main thread waits for a
            decision inside the first client's ``get``, which holds it.
        unresponsive: the ranks of the current group that are dead or stopped now.
        members: whether this replica is a member (counts the replacements that ask to join).
    """

    def __init__(
        self, control: Any, watch_control: Any, unresponsive: Callable[[], list[int]], members: Callable[[], bool]
    ) -> None:
        self._control, self._watch_control = control, watch_control
        self._unresponsive, self._members = unresponsive, members
        self.seconds = 0.0  # spent in votes so far
        self.joiners_seen = 0  # how many replacements have asked to join (the last voter writes it)
        self._pending: str | None = None  # the decision key a vote waits for
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="phalanx-elastic-watchdog", daemon=True)
        with helper_threads_ignore_stop_signals():  # a Ctrl-C is for the main thread
            self._thread.start()

    def cast(self, key: str, voters: int) -> bytes:
        """Votes for ``key``'s pass and returns the decision (``commit N``, N the replacements that
        asked to join by then, or ``abort``): two store round trips, the vote (``add``) and the
        decision, which the last voter writes and the others wait for in the store (``get``)."""
        start = time.perf_counter()
        self._pending = f"{key}/decision"
        try:
            if self._control.add(f"{key}/ok", 1) == voters:
                return self._control.compare_set(f"{key}/decision", "", f"{_COMMIT.decode()} {self.joiners_seen}")
            return self._control.get(f"{key}/decision")
        finally:
            self._pending = None
            self.seconds += time.perf_counter() - start

    def _watch(self) -> None:
        """While a vote waits, looks for dead peers every 50 ms and writes ``abort`` if it finds one;
        counts the replacements that asked to join."""
        while not self._stop.wait(_LIVENESS_S):
            pending = self._pending
            try:
                if self._members():
                    self.joiners_seen = int(self._watch_control.add("joiners", 0))
                if pending is not None and self._unresponsive() and self._pending == pending:
                    self._watch_control.compare_set(pending, "", _ABORT.decode())
            except Exception:  # noqa: BLE001 - the store is gone: the job is ending, the main thread's wait fails
                continue

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


class ElasticCommunicator:
    """A :class:`~phalanx.comm.communicator.Communicator` whose group re-forms without lost replicas.

    Every collective goes to the current generation's
    :class:`~phalanx.comm.group_communicator.ProcessGroupCommunicator`; ``rank`` and
    ``world_size`` are that generation's. A replica's ``member`` id is its rank at the start (a
    replacement's, one no replica had) and names it for good.

    Args:
        spec: this replica's place in the job as it started (every generation's spec derives from it).
        min_size: the fewest replicas the job goes on with.
        backend: ``"gloo"`` (CPU replicas) or ``"nccl"``.
        join_as: a replacement's member id: it is alone (its collectives its own) until it joins
            the running group at its first step (:meth:`join`).
    """

    def __init__(self, spec: GroupSpec, *, min_size: int, backend: str = "gloo", join_as: int | None = None) -> None:
        if not 1 <= min_size <= spec.world_size:
            raise ValueError(f"min_size={min_size} must be between 1 and the job's {spec.world_size} replicas")
        self.backend = backend
        self.min_size = min_size
        # A replacement joins a running group as a new member (phalanx run starts it after a loss):
        # alone until its first step, when the group admits it at a step boundary (join()).
        self.member = spec.rank if join_as is None else join_as
        self.members: list[int] = list(range(spec.world_size)) if join_as is None else []
        self.joining = join_as is not None
        self.grow_pending = False  # the group admits the replicas that asked to join, at the next step
        self._admitted = 0  # how many this group has admitted
        self._grow_to = 0  # how many the last vote counted
        self.generation = 0
        self.changes: list[MembershipChange] = []
        self._spec = spec
        self._step: int | None = None
        self._committed: int | None = None  # the last step whose update every replica applies
        self._votes = 0  # votes in the current step (several backward passes may each sync)
        self._after_vote = 0  # collectives since the vote, in this step (survivors must agree)
        self._closed = False
        self._root = spec.store if spec.store is not None else _connect(spec)
        self._control = dist.PrefixStore(f"{spec.store_prefix}elastic/", self._root)
        self._inner: Any = (
            LocalCommunicator() if self.joining else ProcessGroupCommunicator(self._spec_for(0, self.members), backend)
        )
        self._ballot = Ballot(
            self._control,
            dist.PrefixStore(f"{spec.store_prefix}elastic/", _client(spec)),
            lambda: self._inner.failures.unresponsive_peers(),
            lambda: not self.joining,
        )
        atexit.register(self.close)  # the watchdog ends before the interpreter does

    def _spec_for(self, generation: int, members: list[int]) -> GroupSpec:
        names = tuple(self._label(m) for m in members)
        return replace(
            self._spec,
            rank=members.index(self.member),
            world_size=len(members),
            names=names,
            store=self._root,
            store_prefix=f"{self._spec.store_prefix}g{generation}/",
            explain_failures=False,
            peer_check=None,
        )

    def _label(self, member: int) -> str:
        """How ``member`` is named in every generation: its name in the job as it started, whose
        rank it then held (``replica:2``; ``worker:0 (replica 2)`` where a worker holds several)."""
        label = self._spec.names[member] if member < len(self._spec.names) else f"replica:{member}"
        suffix = f" (rank {member})"
        return label[: -len(suffix)] + f" (replica {member})" if label.endswith(suffix) else label

    # ------------------------------------------------------------------ identity
    @property
    def rank(self) -> int:
        return self._inner.rank

    @property
    def world_size(self) -> int:
        return self._inner.world_size

    @property
    def step(self) -> int | None:
        return self._step

    @step.setter
    def step(self, value: int | None) -> None:
        if value != self._step:
            self._votes = self._after_vote = 0
        self._step = value
        self._inner.step = value

    @property
    def store(self) -> Any:
        return self._inner.store

    @property
    def spec(self) -> GroupSpec:
        return self._inner.spec

    def name(self, rank: int) -> str:
        return self._inner.name(rank)

    def host_of(self, rank: int) -> str:
        return self._inner.host_of(rank)

    def __getattr__(self, name: str) -> Any:
        # What tools read of the communicator (its flight recorder, timers, diagnosis): the
        # current generation's. Only called for names this class does not define.
        if name.startswith("__") or name == "_inner":
            raise AttributeError(name)
        return getattr(self._inner, name)

    # ------------------------------------------------------------------ the vote
    @property
    def vote_seconds(self) -> float:
        """Spent in the votes so far (``benchmarks/elastic.py``: what being elastic costs)."""
        return self._ballot.seconds

    @property
    def voted(self) -> bool:
        """Whether this step's update was agreed on (a failure now re-forms and goes on)."""
        return self._committed is not None and self._committed == self._step

    def commit(self) -> None:
        """Every replica applies this pass's sums, or none does; called once the last bucket has its sum.

        Two store round trips: the vote (``add``), then the decision, which the last voter writes
        and the others wait for in the store (``get``); the watchdog thread writes ``abort`` in
        its place if a peer dies meanwhile.

        Raises:
            GroupChangedError: a replica failed or died before voting; the group re-formed
                without it, and the pass's sums are to be dropped (the step runs again).
        """
        self._votes += 1
        try:
            decided = self._ballot.cast(f"{self.generation}/{self._step}.{self._votes}", self.world_size)
        except RuntimeError as e:  # DistStoreError: no decision within the store's timeout
            raise CollectiveTimeoutError(
                [], step=self._step, operation=f"the vote on {self.name(self.rank)}", cause=str(e)[:200]
            ) from e
        if decided.startswith(_COMMIT):
            self._committed = self._step
            self._after_vote = 0
            joiners = int(decided.split()[1])
            self.grow_pending = joiners > self._admitted
            self._grow_to = max(joiners, self._admitted)
            return
        self._left("the vote", None)

    # ------------------------------------------------------------------ joining
    def join(self, digest: str, at: str = "step") -> bool:
        """A replacement asks to join and waits until the group admits it (at its next step).

        ``digest`` describes this replica's model (its variables' shapes and dtypes): a group whose
        model differs refuses it by name. ``at``: where it joins, ``"step"`` (a step boundary) or
        ``"epoch"`` (Keras ``fit``'s next epoch boundary; the members admit it there).

        Returns:
            False when the job ended before admitting it (nothing left to join).

        Raises:
            ElasticRecoveryError: the group refused it (another model), or never answered.
        """
        index = self._control.add("joiners", 1) - 1
        self._control.set(f"joiner/{index}", json.dumps({"member": self.member, "digest": digest, "at": at}))
        key = f"admitted/{self.member}"
        deadline = time.monotonic() + self._spec.rendezvous_timeout
        while not self._control.check([key]):
            if self._control.check(["ended"]):
                return False
            if time.monotonic() >= deadline:
                raise ElasticRecoveryError(
                    f"{self._label(self.member)} asked to join and was not admitted within "
                    f"{self._spec.rendezvous_timeout:g}s",
                    [],
                )
            time.sleep(_LIVENESS_S)
        answer = json.loads(self._control.get(key))
        if "refused" in answer:
            raise ElasticRecoveryError(
                f"{self._label(self.member)} was refused: {answer['refused']}",
                [self._label(m) for m in answer["members"]],
                hint="start the replacement with the same program and model as the running replicas",
            )
        self.joining = False
        self._admitted = self._grow_to = answer["admitted"]
        self._step = answer["step"]  # the group's (strategy.run takes it too, from replica 0's state)
        self._become(answer["generation"], answer["members"], lost=[])
        return True

    def pending(self) -> list[dict[str, Any]]:
        """The requests of the replacements the last vote counted and no member answered yet."""
        return [json.loads(self._control.get(f"joiner/{i}")) for i in range(self._admitted, self._grow_to)]

    def grow(self, digest: str, refusal: str | None = None, at: str = "step") -> list[str]:
        """The members admit the replicas that asked to join (the last vote counted them); returns
        the names of those admitted. Called by every member at the same step boundary.

        ``refusal``: why none can join now (every member gives the same). ``at``: where the group
        is, ``"step"`` or ``"epoch"`` (Keras ``fit``); a replacement that asked to join elsewhere is
        refused.
        """
        self.grow_pending = False
        asked = self.pending()
        refused = {
            a["member"]: refusal
            or _misplaced(a.get("at", "step"), at)
            or (None if a["digest"] == digest else _differ(a["digest"], digest))
            for a in asked
        }
        fits = [a["member"] for a in asked if refused[a["member"]] is None]
        members, generation = self.members + fits, self.generation + 1
        if self.rank == 0:
            for a in asked:
                answer = {"generation": generation, "members": members, "admitted": self._grow_to, "step": self._step}
                why = refused[a["member"]]
                self._control.set(f"admitted/{a['member']}", json.dumps({**answer, "refused": why} if why else answer))
        self._admitted = self._grow_to
        if fits:
            self._become(generation, members, lost=[])
        return [self._label(m) for m in fits]

    def _become(self, generation: int, members: list[int], lost: list[str], start: float | None = None) -> None:
        """Builds this replica's process group of ``generation`` among ``members``, closes the old one,
        and tells the listeners."""
        start = time.monotonic() if start is None else start
        was, old = list(self.members), self._inner
        before = tuple(old.name(r) for r in range(old.world_size)) if was else ()
        self._inner = ProcessGroupCommunicator(self._spec_for(generation, members), self.backend)
        self._inner.step = self._step
        self.members, self.generation = members, generation
        self._votes = 0  # the new generation's keys are its own
        old.close()
        change = MembershipChange(
            self._step or 0,
            before,
            tuple(self.name(r) for r in range(self.world_size)),
            tuple(lost),
            time.monotonic() - start,
            tuple(self._label(m) for m in members if m not in was) if was else (self._label(self.member),),
        )
        self.changes.append(change)
        with _LOCK:
            listeners = list(_LISTENERS)
        for listener in listeners:
            listener(change)

    # ------------------------------------------------------------------ failures
    def _left(self, operation: str, error: BaseException | None) -> None:
        """A collective failed (or the vote said abort): re-form the group, then raise or go on.

        Before the vote the step is abandoned (:class:`GroupChangedError`); after it, the caller
        makes its collective again on the new group.
        """
        if self._closed:
            raise error if error is not None else RuntimeError("closed")
        after_vote = self.voted
        if not after_vote and error is not None:
            # Nobody applies this step: a replica still waiting for the decision reads it here.
            key = f"{self.generation}/{self._step}.{self._votes + 1}/decision"
            self._control.compare_set(key, "", _ABORT.decode())
        before = [self.name(r) for r in range(self.world_size)]
        lost = self._regroup()
        if after_vote:
            return
        raise GroupChangedError(
            lost, step=self._step, before=len(before), after=self.world_size, operation=operation
        ) from error

    def _regroup(self) -> list[str]:
        """Re-forms the group among the survivors; returns the names of the replicas lost."""
        start = time.monotonic()
        old, old_inner, gen = list(self.members), self._inner, self.generation + 1
        old_names = [old_inner.name(r) for r in range(len(old))]
        old_inner.abort()  # nobody waits for this replica in the old group any more
        where = {"committed": self._committed, "step": self._step, "after_vote": self._after_vote}
        self._control.set(f"{gen}/here/{self.member}", json.dumps(where))
        members_key = f"{gen}/members"
        deadline = start + self._spec.rendezvous_timeout
        while not self._control.check([members_key]):
            here = [m for m in old if self._control.check([f"{gen}/here/{m}"])]
            dead = {old[r] for r in old_inner.failures.unresponsive_peers()}
            missing = [m for m in old if m not in here]
            if all(m in dead for m in missing):
                self._control.compare_set(members_key, "", json.dumps(here))
                break
            if time.monotonic() >= deadline:
                raise ElasticRecoveryError(
                    f"{', '.join(old_names[old.index(m)] for m in missing)} neither re-joined nor died within "
                    f"{self._spec.rendezvous_timeout:g}s",
                    [old_names[old.index(m)] for m in here],
                )
            time.sleep(_LIVENESS_S / 5)
        members = [int(m) for m in json.loads(self._control.get(members_key))]
        survivors = [old_names[old.index(m)] for m in members]
        if self.member not in members:
            raise ElasticRecoveryError(
                f"{old_names[old.index(self.member)]} was left out of the re-formed group", survivors
            )
        if len(members) < self.min_size:
            raise ElasticRecoveryError(
                f"{len(members)} replica(s) remain, fewer than the job's minimum of {self.min_size}", survivors
            )
        places = {m: json.loads(self._control.get(f"{gen}/here/{m}")) for m in members}
        if len({json.dumps(p, sort_keys=True) for p in places.values()}) > 1:
            raise ElasticRecoveryError(
                "the survivors were at different points of the job ("
                + "; ".join(f"{old_names[old.index(m)]}: {p}" for m, p in places.items())
                + ")",
                survivors,
            )
        lost = [old_names[old.index(m)] for m in old if m not in members]
        self._become(gen, members, lost, start)
        return lost

    def _recover(self, operation: str, error: PeerUnavailableError, tensor: torch.Tensor | None, saved: Any) -> None:
        """After a failed collective: re-forms the group (raising before the vote), then puts the
        collective's input back as it was, for the caller to make it again on the new group."""
        self._left(operation, error)
        if saved is not None:
            tensor.copy_(saved)  # type: ignore[union-attr]

    def _guarded(self, operation: str, call: Callable[[], Any], tensor: torch.Tensor | None) -> Any:
        """Runs ``call`` (a collective); on a lost peer re-forms the group and, after the vote, calls again."""
        saved = tensor.clone() if tensor is not None and self.voted else None
        while True:
            try:
                result = call()
                break
            except PeerUnavailableError as e:
                self._recover(operation, e, tensor, saved)
        if self.voted:
            self._after_vote += 1
        return result

    # ------------------------------------------------------------------ collectives
    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> Handle:
        saved = tensor.clone() if self.voted else None

        def start() -> Handle:
            while True:
                try:
                    return self._inner.all_reduce(tensor, op)
                except PeerUnavailableError as e:  # shared memory: the whole collective is in the call
                    self._recover("all-reduce", e, tensor, saved)

        handle, result = [start()], [tensor]

        def finish() -> None:
            while True:
                try:
                    result[0] = handle[0].wait()
                    break
                except PeerUnavailableError as e:
                    self._recover("all-reduce", e, tensor, saved)
                    handle[0] = start()
            if self.voted:
                self._after_vote += 1

        return Handle(tensor, finish, lambda _: result[0])

    def reduce(self, tensor: torch.Tensor, dst: int = 0) -> torch.Tensor:
        return self._guarded("reduce", lambda: self._inner.reduce(tensor, dst), tensor)

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        return self._guarded("broadcast", lambda: self._inner.broadcast(tensor, src), tensor)

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        return self._guarded("all-gather", lambda: self._inner.all_gather(tensor), None)

    def barrier(self) -> None:
        self._guarded("barrier", self._inner.barrier, None)

    def subgroup(self, ranks: list[int], tag: str, *, cuda: bool = False) -> Any:
        return self._inner.subgroup(ranks, tag, cuda=cuda)

    def errors_for(self, operation: str, slot: int | None = None) -> Any:
        return self._inner.errors_for(operation, slot)

    def wait_for_chief(self, what: str = "chief-only work") -> Iterator[None]:
        return self._inner.wait_for_chief(what)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            atexit.unregister(self.close)
            if not self.joining:  # a replacement still waiting to join: the job has ended
                with contextlib.suppress(Exception):
                    self._control.set("ended", "1")
            self._ballot.close()
            self._inner.close()
