"""One diagnosis of a hang or a mismatch, from every replica's snapshot: who is where, and why.

A *snapshot* (:mod:`phalanx.comm.snapshot`) is what one replica says about itself: its flight
recorder's last collectives (:mod:`phalanx.comm.flight_recorder`), where its main thread is (its
live Python stack), how much CPU it used a moment ago, and what it declared it does alone
(``phalanx.wait_for_chief``). :func:`analyse` puts the replicas' snapshots side by side:

* **Where each replica is**: waiting in a collective (which one, for what, from which line, for
  how long), or in its own code (the innermost frames of its stack that are the user's, and
  whether it is running, 50 % of a core and more, or blocked: asleep, reading, waiting on a lock);
  dead, stopped (SIGSTOP, a debugger) or silent when it could not answer.
* **Where their histories part**: the first collective (by sequence number) that two replicas
  made differently (another operation, purpose, size, dtype or source line), with both lines and
  a verdict: an extra call on one replica, a call one replica missed, a step one replica
  skipped, another size at the same line (another shape; for gradient buckets, parameters in
  another order or of other shapes), or calls in another order.
* **The cause**: the replica that parted, else those that never arrived at the collective the
  others wait in (never the replica that waited), else, when every replica is in the same
  collective, the transport.

This module is pure Python (no torch): the supervisor and ``phalanx diagnose`` read and print
what the replicas wrote (:func:`read`, :func:`render`) without importing torch.

Example:
    >>> waiter = {"rank": 0, "name": "replica:0 (rank 0)", "step": 2, "time": 10.0, "collectives": [
    ...     {"seq": 1, "op": "all_reduce", "kind": "gradient bucket", "numel": 5, "dtype": "float32",
    ...      "step": 1, "site": ["t.py", 7, "step", "loss.backward()"], "start": 1.0, "end": 1.1,
    ...      "error": None},
    ...     {"seq": 2, "op": "all_reduce", "kind": "gradient bucket", "numel": 5, "dtype": "float32",
    ...      "step": 2, "site": ["t.py", 7, "step", "loss.backward()"], "start": 5.0, "end": None,
    ...      "error": None}]}
    >>> sleeper = {"rank": 1, "name": "replica:1 (rank 1)", "step": 1, "time": 10.0,
    ...     "collectives": waiter["collectives"][:1], "cpu": 0.0,
    ...     "stack": [{"file": "t.py", "line": 20, "function": "<module>", "text": "time.sleep(1000)", "user": True}]}
    >>> d = analyse({0: waiter, 1: sleeper}, 2)
    >>> d["culprits"]
    [1]
    >>> print(d["summary"])  # doctest: +ELLIPSIS
    replica:1 (rank 1) never arrived at collective #2: it is in its own code at t.py:20 (`time.sleep(1000)`), ...
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Iterator
from typing import Any

__all__ = ["FILE", "analyse", "diagnosing", "pending", "read", "render", "write"]

FILE = "diagnosis.json"  # in the run directory (LOGDIR/<run-id>/), where the launcher reads it
# The share of the time a replica's main thread was running or runnable (waiting for a core) at or
# above which a replica in its own code is running (busy), not blocked (asleep, reading, waiting).
RUNNING = 0.5
VERSION = 1


# ----------------------------------------------------------------------------- describing one collective
def _what(c: dict[str, Any]) -> str:
    """``the gradient all-reduce (13 float32)``, ``reduce (1 float32)``, ``barrier``."""
    kind = c.get("kind") or c.get("op") or "collective"
    size = f" ({c['numel']:,} {c['dtype']})" if c.get("numel") else ""
    names = {"gradient bucket": "gradient all-reduce", "all_reduce": "all-reduce", "all_gather": "all-gather"}
    return f"{names.get(kind, kind)}{size}"


def _line(site: list | None) -> str:
    """``job.py:17 (`loss.backward()`)``, or '' for no site."""
    if not site:
        return ""
    text = f" (`{site[3]}`)" if len(site) > 3 and site[3] else ""
    return f"{os.path.basename(str(site[0]))}:{site[1]}{text}"


def _collective(c: dict[str, Any], *, step: bool = True) -> str:
    """``collective #17, the gradient all-reduce (13 float32) of step 5, from job.py:17 (`...`)``."""
    where = _line(c.get("site"))
    of = f" of step {c['step']}" if step and c.get("step") is not None else ""
    return f"collective #{c['seq']}, the {_what(c)}{of}" + (f", from {where}" if where else "")


def _place(c: dict[str, Any]) -> tuple:
    """What makes two calls the same call in a program: the operation, its purpose, its line."""
    site = c.get("site") or []
    return (c.get("op"), c.get("kind"), tuple(site[:2]))


def _signature(c: dict[str, Any]) -> tuple:
    """Two replicas' calls with one sequence number must match in all of this, the step included
    (every replica runs the same steps: a replica a step ahead skipped one)."""
    return (*_place(c), c.get("numel"), c.get("dtype"), c.get("step"))


# ----------------------------------------------------------------------------- where a replica is
def _user_frames(snapshot: dict[str, Any], count: int = 3) -> list[dict[str, Any]]:
    """The innermost ``count`` frames of the replica's main thread that are the user's, innermost first."""
    return [f for f in reversed(snapshot.get("stack") or []) if f.get("user")][:count]


def _in_flight(snapshot: dict[str, Any]) -> dict[str, Any] | None:
    """The collective the replica waits in (or was waiting in when it failed), if any."""
    history = snapshot.get("collectives") or []
    if history and (history[-1].get("end") is None or history[-1].get("error")):
        return history[-1]
    return None


def _last_seq(snapshot: dict[str, Any]) -> int:
    history = snapshot.get("collectives") or []
    return int(history[-1]["seq"]) if history else 0


def _own_code(snapshot: dict[str, Any]) -> str:
    """``in its own code at job.py:28 (`time.sleep(1000)`), step 4, blocked (0% of a core)``."""
    frames = _user_frames(snapshot)
    stack = snapshot.get("stack") or []
    if frames:
        top = frames[0]
        text = f" (`{top['text']}`)" if top.get("text") else ""
        where = f"in its own code at {os.path.basename(str(top['file']))}:{top['line']}{text}"
        if stack and not stack[-1].get("user"):  # deeper, in a library's code (phalanx's, torch's)
            inner = stack[-1]
            where = (
                f"not in a collective, in {os.path.basename(str(inner['file']))}:{inner['line']} ({inner['function']}) "
                f"called from its code at {os.path.basename(str(top['file']))}:{top['line']}{text}"
            )
    else:
        where = "in its own code, outside phalanx (no frame of it on its stack)"
    cpu = snapshot.get("cpu")
    how = ""
    if cpu is not None:
        share = f"{round(100 * cpu)}% of a core"
        if _busy(snapshot):
            runnable = snapshot.get("runnable")
            waiting = (
                f", {round(100 * (runnable - cpu))}% waiting for one" if runnable and runnable - cpu >= 0.05 else ""
            )
            how = f", running ({share}{waiting})"
        else:
            how = f", blocked ({share}: asleep, reading, or waiting on a lock)"
    step = f", step {snapshot['step']}" if snapshot.get("step") is not None else ""
    return f"{where}{step}{how}"


def _busy(snapshot: dict[str, Any]) -> bool:
    """Whether a replica's main thread was running (or runnable, waiting for a core) most of the time."""
    share = snapshot.get("runnable")
    share = snapshot.get("cpu") if share is None else share
    return share is not None and share >= RUNNING


# ----------------------------------------------------------------------------- where histories part
def _parting(snapshots: dict[int, dict[str, Any]]) -> dict[str, Any] | None:
    """The first collective two replicas made differently, with a verdict and its culprit."""
    histories = {r: {int(c["seq"]): c for c in s.get("collectives") or []} for r, s in snapshots.items()}
    seqs = sorted({seq for h in histories.values() for seq in h})
    for seq in seqs:
        holders = [r for r in sorted(histories) if seq in histories[r]]
        if len(holders) < 2:
            continue
        a = holders[0]
        for b in holders[1:]:
            ca, cb = histories[a][seq], histories[b][seq]
            if _signature(ca) != _signature(cb):
                return _verdict(seq, a, b, ca, cb, snapshots)
    return None


def _verdict(
    seq: int, a: int, b: int, ca: dict[str, Any], cb: dict[str, Any], snapshots: dict[int, dict[str, Any]]
) -> dict[str, Any]:
    """What the first differing calls ``ca`` (replica ``a``) and ``cb`` (replica ``b``) say happened."""
    name = {r: snapshots[r].get("name", f"replica {r}") for r in (a, b)}
    calls = [f"{name[a]} made {_collective(ca)}", f"{name[b]} made {_collective(cb)}"]
    steps = (ca.get("step"), cb.get("step"))
    found: dict[str, Any] = {"seq": seq, "calls": calls}
    if _place(ca) == _place(cb) and steps[0] == steps[1]:  # the same call, another size or dtype
        what = f"{ca['numel']:,} {ca['dtype']} on {name[a]}, {cb['numel']:,} {cb['dtype']} on {name[b]}"
        if ca.get("kind") == "gradient bucket":
            return found | {
                "verdict": "gradient buckets that differ",
                "culprit": b,
                "text": f"the gradient all-reduce of step {steps[0]} from {_line(ca.get('site'))} holds {what}",
                "hint": "the replicas' models must have the same parameters, created in the same order: build the "
                "model the same way on every replica, inside strategy.scope()",
            }
        return found | {
            "verdict": "a collective with another shape",
            "culprit": b,
            "text": f"the {_what({**ca, 'numel': 0})} at {_line(ca.get('site'))}, step {steps[0]}, got {what}",
            "hint": f"{name[b]} passed a tensor of another shape or dtype than {name[a]}: every replica must pass the "
            "same shape and dtype to a collective",
        }
    if _place(ca) == _place(cb):  # the same call, at another step: one replica made no collective in a step
        ahead = a if (steps[0] or 0) > (steps[1] or 0) else b
        missed = min(s for s in steps if s is not None) if None not in steps else None
        return found | {
            "verdict": "a skipped step",
            "culprit": ahead,
            "text": f"{name[ahead]} made no collective in step {missed}: its collective #{seq} is already step "
            f"{max(s or 0 for s in steps)}'s {_what(ca)} from {_line(ca.get('site'))}",
            "hint": "a step raised on one replica only (an exception caught around strategy.run), or a "
            "data-dependent `continue`: every replica must run every step",
        }
    a_knows_b = any(_place(c) == _place(cb) for c in snapshots[a].get("collectives") or [])
    b_knows_a = any(_place(c) == _place(ca) for c in snapshots[b].get("collectives") or [])
    if a_knows_b != b_knows_a:  # one replica made a call the other never made: an extra call
        extra, other = (b, a) if not a_knows_b else (a, b)
        call = cb if extra == b else ca
        line = _line(call.get("site")) or "?"
        return found | {
            "verdict": "an extra collective",
            "culprit": extra,
            "text": f"{name[extra]} made an extra {_what(call)} at {line}, step {call.get('step')}, that "
            f"{name[other]} never made",
            "hint": f"every replica must make the same collectives in the same order: the call at {line} runs on "
            f"{name[extra]} only (a condition on the replica, its data or its rank?)",
        }
    if steps[0] != steps[1]:  # each call is known to both: the replica that moved on missed one
        ahead = a if (steps[0] or 0) > (steps[1] or 0) else b
        missed, went = (ca, cb) if ahead == b else (cb, ca)
        line = _line(missed.get("site")) or "?"
        if not any(c.get("step") == missed.get("step") for c in snapshots[ahead].get("collectives") or []):
            return found | {
                "verdict": "a skipped step",
                "culprit": ahead,
                "text": f"{name[ahead]} made no collective in step {missed.get('step')}: it went on to "
                f"{_collective(went)}",
                "hint": "a step raised on one replica only (an exception caught around strategy.run), or a "
                "data-dependent `continue`: every replica must run every step",
            }
        return found | {
            "verdict": "a missing collective",
            "culprit": ahead,
            "text": f"{name[ahead]} did not make the {_what(missed)} at {line} in step {missed.get('step')}, as it "
            f"did in earlier steps: it went on to {_collective(went)}",
            "hint": f"every replica must make the same collectives in the same order: the call at {line} was "
            f"skipped on {name[ahead]} (a condition on the replica, its data or its rank?)",
        }
    return found | {
        "verdict": "collectives in another order",
        "culprit": b,
        "text": f"{name[a]} and {name[b]} made different collectives at the same point of step {steps[0]}",
        "hint": "every replica must make the same collectives in the same order",
    }


# ----------------------------------------------------------------------------- the diagnosis
def analyse(
    snapshots: dict[int, dict[str, Any]],
    world_size: int,
    *,
    absent: dict[int, str] | None = None,
    names: dict[int, str] | None = None,
    trigger: dict[str, Any] | None = None,
    timeout: float | None = None,
    live: bool = False,
    now: float | None = None,
) -> dict[str, Any]:
    """Puts the replicas' snapshots side by side (see the module docstring).

    Args:
        snapshots: rank -> its snapshot, for the replicas that answered.
        world_size: the job's replicas.
        absent: rank -> why it has no snapshot (``"dead (its process exited)"``, ``"stopped
            (SIGSTOP or a debugger)"``); a rank in neither is "silent".
        names: rank -> its name, where no snapshot gives it.
        trigger: what made a replica ask: ``{"rank", "error", "operation", "seq"}``.
        timeout: the collective timeout in effect (``PHALANX_COLLECTIVE_TIMEOUT``).
        live: asked while the job runs (``phalanx diagnose --live``): nothing failed, so a replica
            that has not arrived yet is only not there yet.
        now: the wall-clock time of the diagnosis (default: now).

    Returns:
        A JSON-able dict: ``replicas`` (per rank: ``state``, ``where``), ``parting``,
        ``agree_up_to``, ``culprits`` (ranks), ``summary`` (one line), ``hint``, and the
        ``snapshots`` themselves.
    """
    absent = dict(absent or {})
    names = dict(names or {})
    now = time.time() if now is None else now
    if timeout is None:
        timeout = next((s.get("timeout") for s in snapshots.values() if s.get("timeout")), None)
    for r, s in snapshots.items():
        names.setdefault(r, s.get("name") or f"replica {r}")
    for r in range(world_size):
        names.setdefault(r, f"replica {r}")
    parting = _parting(snapshots)
    fronts = [c["seq"] for s in snapshots.values() if (c := _in_flight(s)) is not None]
    front = max(fronts) if fronts else None
    culprits: list[int] = []
    replicas = []
    for r in range(world_size):
        s = snapshots.get(r)
        entry: dict[str, Any] = {"rank": r, "name": names[r]}
        if s is None:
            why = absent.get(r, "silent: it did not answer (its main thread holds the GIL, or it cannot reach the job)")
            entry.update(state=why.split(" ", 1)[0].rstrip(":"), where=why)
            if not live or why.startswith(("dead", "stopped")):
                culprits.append(r)
        elif s.get("ended"):  # it closed its strategy (its program ended) and its process is gone
            last = (s.get("collectives") or [{}])[-1]
            entry.update(
                pid=s.get("pid"),
                step=s.get("step"),
                seq=_last_seq(s),
                state="ended",
                where=f"ended: it closed its strategy after collective #{_last_seq(s)}"
                + (f" ({_line(last.get('site'))})" if last.get("site") else ""),
            )
        else:
            entry.update(pid=s.get("pid"), step=s.get("step"), seq=_last_seq(s))
            c = _in_flight(s)
            if c is not None:
                waited = max(0.0, (s.get("time") or now) - (c.get("start") or now))
                failed = f" and failed ({c['error']})" if c.get("error") else ""
                how = f"waits ({waited:.1f} s so far)" if live else f"waited {waited:.1f} s{failed}"
                entry.update(state="collective", where=f"{how} in {_collective(c)}")
            else:
                entry.update(state="own code", where=_own_code(s), busy=_busy(s))
                if s.get("busy"):
                    entry["where"] += f"; declared: {s['busy'].get('what')} (phalanx.wait_for_chief)"
                if front is not None and _last_seq(s) < front:
                    entry["where"] += (
                        f"; it has not reached collective #{front} yet" if live else f"; it never reached #{front}"
                    )
                    if not live:
                        culprits.append(r)
            chief = s.get("waiting_for_chief")
            if chief:
                entry["where"] += (
                    f"; waits for the chief's {chief.get('what')} ({chief.get('seconds', 0):.1f} s so far)"
                )
        replicas.append(entry)
    ended = [e for e in replicas if e["state"] == "ended"]
    if ended and parting is None and not culprits and front is not None:
        # The others wait in a collective that an ended replica never made: theirs is the extra call.
        culprits = [
            e["rank"] for e in replicas if e["state"] == "collective" and e["seq"] > min(x["seq"] for x in ended)
        ]
    if parting is not None:
        culprits = [parting["culprit"]] + [r for r in culprits if r != parting["culprit"]]
    agree = (parting["seq"] - 1) if parting is not None else min((_last_seq(s) for s in snapshots.values()), default=0)
    summary, hint = _summary(parting, culprits, replicas, snapshots, front, timeout, live)
    return {
        "version": VERSION,
        "time": now,
        "attempt": os.environ.get("PHALANX_RESTART_COUNT", "0"),  # a launcher's restart of the job
        "live": live,
        "world_size": world_size,
        "timeout": timeout,
        "trigger": trigger,
        "replicas": replicas,
        "parting": parting,
        "agree_up_to": agree,
        "front": front,
        "culprits": culprits,
        "summary": summary,
        "hint": hint,
        "snapshots": {str(r): s for r, s in snapshots.items()},
    }


def _summary(
    parting: dict[str, Any] | None,
    culprits: list[int],
    replicas: list[dict[str, Any]],
    snapshots: dict[int, dict[str, Any]],
    front: int | None,
    timeout: float | None,
    live: bool,
) -> tuple[str, str]:
    bound = f"PHALANX_COLLECTIVE_TIMEOUT ({timeout:g} s)" if timeout else "PHALANX_COLLECTIVE_TIMEOUT"
    if parting is not None:
        return f"the replicas' collectives part at #{parting['seq']}, {parting['verdict']}: {parting['text']}", str(
            parting["hint"]
        )
    if not culprits:
        if live:
            return "the job runs: " + "; ".join(f"{e['name']} {e['where']}" for e in replicas), (
                f"a replica waits for the others at most {bound}; nothing here is past it"
            )
        if front is not None and all(e["state"] == "collective" for e in replicas):
            starts = {
                r: c["start"] for r, s in snapshots.items() if (c := _in_flight(s)) is not None and c.get("start")
            }
            if len(starts) > 1 and timeout and max(starts.values()) - min(starts.values()) > timeout / 2:
                late, early = max(starts, key=starts.get), min(starts, key=starts.get)
                name = next(e["name"] for e in replicas if e["rank"] == late)
                other = next(e["name"] for e in replicas if e["rank"] == early)
                gap = starts[late] - starts[early]
                return (
                    f"{name} reached collective #{front} {gap:.1f} s after {other}, too late for {bound}",
                    f"{name} was slow to get there (its own work before the collective, or a host so crowded that "
                    f"its processes wait for a core); raise PHALANX_COLLECTIVE_TIMEOUT if that is expected",
                )
            return (
                f"every replica is in collective #{front}; none is missing, so the transport did not deliver",
                "check the network between the hosts (a firewall, a partition), or the process group's backend",
            )
        return "no replica is missing and none parted", ""
    first = next(e for e in replicas if e["rank"] == culprits[0])
    name = first["name"]
    gone = [e for e in replicas if e["state"] == "ended"]
    if first["state"] == "collective" and gone:
        c = _in_flight(snapshots[culprits[0]]) or {}
        others = ", ".join(e["name"] for e in gone)
        return f"{name} made {_collective(c)} after {others} had ended its program: " + "; ".join(
            f"{e['name']} {e['where']}" for e in gone
        ), (
            f"every replica must make the same collectives: the call at {_line(c.get('site')) or '?'} runs on "
            f"{name} only, or {others} left early (a shorter loop, a `break`, data that ran out first)"
        )
    if first["state"] in ("dead", "stopped", "silent"):
        return f"{name} is {first['where']}", (
            "synchronous training cannot go on without every replica; the launcher names how a dead replica ended"
        )
    at = f" at collective #{front}" if front is not None else ""
    s = snapshots.get(culprits[0], {})
    how = "busy, not stuck: " if _busy(s) else ""
    summary = f"{name} never arrived{at}: it is {how}{first['where'].split('; it never reached', 1)[0]}"
    if _busy(s):
        hint = (
            f"{name} was busy running its own code, not stuck, while the others waited longer than {bound}. For work "
            "that one replica does alone (an evaluation or a save on the chief) and that may last longer, wrap it in "
            "`with phalanx.wait_for_chief():` on every replica (the others then wait for as long as the chief is "
            "alive), or raise PHALANX_COLLECTIVE_TIMEOUT"
        )
    else:
        hint = (
            f"{name} is blocked in its own code (asleep, reading, or waiting on a lock) and did not arrive within "
            f"{bound}: see its line above"
        )
    return summary, hint


# ----------------------------------------------------------------------------- showing and keeping it
def render(diagnosis: dict[str, Any], *, where: str | None = None) -> str:
    """The diagnosis as the lines the launcher prints (``where``: the file it is kept in, if any)."""
    live = diagnosis.get("live")
    trigger = diagnosis.get("trigger") or {}
    head = "live view of the job (nothing was stopped)" if live else "diagnosis"
    if trigger.get("error"):
        head += f" of {trigger['error']} on {trigger.get('name', 'a replica')}"
    if diagnosis.get("timeout"):
        head += f"; PHALANX_COLLECTIVE_TIMEOUT is {diagnosis['timeout']:g} s"
    lines = [
        head + (f" (kept in {where}; `phalanx diagnose {os.path.dirname(where)}` prints it again)" if where else "")
    ]
    culprits = diagnosis.get("culprits") or []
    for e in sorted(diagnosis.get("replicas") or [], key=lambda e: (e["rank"] not in culprits, e["rank"])):
        pid = f", pid {e['pid']}" if e.get("pid") else ""
        mark = "  <- the cause" if culprits and e["rank"] == culprits[0] and not live else ""
        lines.append(f"  {e['name']}{pid}: {e['where']}{mark}")
        snapshot = (diagnosis.get("snapshots") or {}).get(str(e["rank"]))
        if snapshot and e.get("state") == "own code":
            for f in _user_frames(snapshot)[1:]:
                lines.append(f"      called from {os.path.basename(str(f['file']))}:{f['line']} in {f['function']}")
    parting = diagnosis.get("parting")
    if parting is not None:
        lines.append(f"  histories part at collective #{parting['seq']}, {parting['verdict']}: {parting['text']}")
        lines.extend(f"      {call}" for call in parting.get("calls") or [])
    elif diagnosis.get("agree_up_to") and len(diagnosis.get("snapshots") or {}) > 1:
        lines.append(f"  histories: the same on every replica up to collective #{diagnosis['agree_up_to']}")
    if diagnosis.get("hint"):
        lines.append(f"  HINT: {diagnosis['hint']}")
    return "\n".join(lines)


def write(diagnosis: dict[str, Any], directory: str, *, keep_within: float = 0.0) -> str:
    """Writes ``directory/diagnosis.json`` whole or not at all; returns its path.

    Args:
        keep_within: a diagnosis of the same attempt (``attempt``) written less than this many
            seconds ago is kept, unless this one finds where the replicas' collectives part and it
            did not: the first replica to diagnose a failure saw its peers before they failed in
            turn (a peer that raised its own error and exited looks dead to the next one).
    """
    path = os.path.join(directory, FILE)
    if keep_within > 0:
        earlier = read(directory, since=time.time() - keep_within)
        if (
            earlier is not None
            and earlier.get("attempt") == diagnosis.get("attempt")
            and (earlier.get("parting") is not None or diagnosis.get("parting") is None)
        ):
            return path
    temporary = f"{path}.{os.getpid()}.tmp"
    with open(temporary, "w") as f:
        json.dump(diagnosis, f, indent=1, default=str)
    os.replace(temporary, path)
    return path


def read(directory: str, *, since: float | None = None) -> dict[str, Any] | None:
    """The diagnosis kept in ``directory`` (written at ``since`` or later), or None."""
    path = os.path.join(directory, FILE)
    try:
        if since is not None and os.path.getmtime(path) < since:
            return None
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and data.get("version") == VERSION else None


_PENDING = os.path.join("diagnosis", "pending-")  # in the run directory: a replica diagnosing now


@contextlib.contextmanager
def diagnosing(directory: str, rank: int) -> Iterator[None]:
    """Marks, for the launcher, that replica ``rank`` is diagnosing a failure (it should not be stopped yet)."""
    marker = os.path.join(directory, f"{_PENDING}{rank}")
    try:
        os.makedirs(os.path.dirname(marker), exist_ok=True)
        with open(marker, "w") as f:
            f.write(str(os.getpid()))
    except OSError:
        marker = ""
    try:
        yield
    finally:
        if marker:
            with contextlib.suppress(OSError):
                os.unlink(marker)


def pending(directory: str) -> bool:
    """Whether a replica that writes to ``directory`` is diagnosing a failure now (its process alive)."""
    folder = os.path.join(directory, os.path.dirname(_PENDING))
    try:
        names = [n for n in os.listdir(folder) if n.startswith(os.path.basename(_PENDING))]
    except OSError:
        return False
    for name in names:
        try:
            with open(os.path.join(folder, name)) as f:
                pid = int(f.read().strip() or 0)
            os.kill(pid, 0)  # a marker of a replica that died while diagnosing does not count
        except (OSError, ValueError):
            continue
        return True
    return False
