"""Multi-process tests of phalanx.comm.shm.ShmAllReduce.

Each test starts real processes (this file run as a script, one per rank) that meet through a
real TCPStore hosted by the test process. Every launch has a hard deadline: on expiry each child
dumps its Python stacks (faulthandler on PHALANX_STACK_SIGNAL) and is killed, and the test fails with the
dumps. Every child is reaped, and no segment of ours may remain in /dev/shm.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
import traceback
import uuid
import zlib
from datetime import timedelta
from pathlib import Path

import psutil
import pytest
import torch

from phalanx.config import stack_signal

from conftest import start_process

SHM_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else None

OPS = ("sum", "mean", "max", "min", "product")
DTYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int32": torch.int32,
    "int64": torch.int64,
}
_FN = {"sum": torch.add, "mean": torch.add, "product": torch.mul, "max": torch.maximum, "min": torch.minimum}


# ---------------------------------------------------------------------------- helpers (both sides)
def _inputs(world: int, numel: int, dtype: torch.dtype, op: str, seed: int) -> list[torch.Tensor]:
    """Every rank's input; all ranks generate all of them, to compute the reference."""
    g = torch.Generator().manual_seed(seed)
    xs = []
    for _ in range(world):
        if dtype.is_floating_point:
            x = torch.randn(numel, generator=g, dtype=torch.float64)
            if op == "product":
                x = 0.5 + x.abs().clamp(max=1.0)  # keeps products finite
            xs.append(x.to(dtype))
        else:
            hi = 4 if op == "product" else 1000
            xs.append(torch.randint(-hi, hi + 1, (numel,), generator=g, dtype=dtype))
    return xs


def _reference(xs: list[torch.Tensor], op: str) -> torch.Tensor:
    """The reduction in rank order: ((x0 op x1) op x2) ..."""
    ref = xs[0].clone()
    for x in xs[1:]:
        ref = _FN[op](ref, x)
    if op == "mean":
        n = len(xs)
        ref = ref / n if ref.is_floating_point() else torch.div(ref, n, rounding_mode="trunc")
    return ref


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(-1).view(torch.uint8)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(_bits(a), _bits(b))


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(_bits(t).numpy().tobytes()).hexdigest()


def _ours(prefix: str) -> list[str]:
    return glob.glob(os.path.join(SHM_DIR, f"{prefix}-*")) if SHM_DIR else []


# ---------------------------------------------------------------------------- child scenarios
def _check_case(comm, rank, world, numel, dtype, op, seed, out, key):
    xs = _inputs(world, numel, dtype, op, seed)
    t = xs[rank].clone()
    assert comm.all_reduce(t, op) is t
    ref = _reference(xs, op)
    if not _same_bits(t, ref):
        diff = (t.double() - ref.double()).abs().max().item()
        out["mismatches"].append(f"{key}: max |diff| {diff}")
    out["digests"][key] = _digest(t)


def scenario_matrix(comm, rank, world, store, sizes, dtypes):
    out = {"digests": {}, "mismatches": []}
    for numel in sizes:
        for dname in dtypes:
            for op in OPS:
                key = f"{numel}/{dname}/{op}"
                _check_case(comm, rank, world, numel, DTYPES[dname], op, zlib.crc32(key.encode()), out, key)
    return out


def scenario_huge(comm, rank, world, store, numel, ops):
    out = {"digests": {}, "mismatches": []}
    for i, op in enumerate(ops):
        _check_case(comm, rank, world, numel, torch.float32, op, 7 + i, out, f"{numel}/{op}")
    return out


def scenario_noncontiguous(comm, rank, world, store, prefix):
    out = {"digests": {}, "mismatches": []}
    comm.all_reduce(torch.ones(3))  # every rank has finished its constructor ...
    out["left_while_open"] = _ours(prefix)  # ... so the segment is already unlinked
    cases = [  # (numel of the 1-D buffer, view of it, op)
        (37 * 53, lambda x: x.view(37, 53).t(), "sum"),  # transposed
        (74 * 53, lambda x: x.view(74, 53)[:, ::2], "max"),  # strided: gaps in the buffer
        (2 * 3 * 651, lambda x: x.view(2, 3, 651)[:, 1].t(), "mean"),
        (257 * 1021, lambda x: x.view(257, 1021).t(), "product"),  # large path
        (10, lambda x: x[5:6].view(()), "min"),  # 0-dim
    ]
    for i, (numel, make, op) in enumerate(cases):
        bufs = _inputs(world, numel, torch.float32, op, 100 + i)
        ref = _reference([make(b).contiguous() for b in bufs], op)
        buf = bufs[rank].clone()
        mine = make(buf)
        layout = (mine.data_ptr(), mine.shape, mine.stride())
        assert comm.all_reduce(mine, op) is mine
        assert (mine.data_ptr(), mine.shape, mine.stride()) == layout
        if not _same_bits(mine.contiguous(), ref):
            out["mismatches"].append(f"case {i} ({op}): wrong result")
        outside = torch.ones(numel, dtype=torch.bool)
        make(outside).fill_(False)
        if not torch.equal(buf[outside], bufs[rank][outside]):
            out["mismatches"].append(f"case {i}: wrote outside the view")
        out["digests"][str(i)] = _digest(mine.contiguous())
    return out


def scenario_repeat(comm, rank, world, store, iterations):
    """Back-to-back calls of varying size/op with random stalls, so ranks drift apart."""
    out = {"digests": {}, "mismatches": []}
    jitter = random.Random(1000 + rank)
    sizes = [1, 5, 4096, 70_000, 300_001]  # small and large paths, one and two chunks
    for it in range(iterations):
        numel, op = sizes[it % len(sizes)], OPS[it % len(OPS)]
        if jitter.random() < 0.3:
            time.sleep(jitter.random() * 2e-3)
        _check_case(comm, rank, world, numel, torch.float32, op, it, out, f"{it}")
    return out


def scenario_peer_death(comm, rank, world, store, dying, numel, mid_call):
    from phalanx.errors import DistributedRuntimeError, PeerUnavailableError

    def die():
        store.set("exit_time", repr(time.time()))
        os._exit(1)

    t = torch.ones(numel)
    for _ in range(5):
        comm.all_reduce(t)
    if rank == dying:
        if not mid_call:
            die()  # between calls
        threading.Timer(0.01, die).start()  # inside a call: a 64 MB one takes > 10 ms
        while True:
            comm.all_reduce(t)
    try:
        for _ in range(10_000):
            comm.all_reduce(t)
    except PeerUnavailableError as e:
        raised = time.time()
        exited = float(store.get("exit_time").decode())
        try:
            comm.all_reduce(t)
            closed = False
        except DistributedRuntimeError:
            closed = True
        return {
            "type": type(e).__name__,
            "peers": e.peers,
            "delay": raised - exited,
            "closed_after": closed,
            "message": str(e),
        }
    return {"type": None}


def scenario_stall(comm, rank, world, store, sleep):
    from phalanx.errors import PeerUnavailableError

    t = torch.ones(100)
    comm.all_reduce(t)
    if rank == 1:
        time.sleep(sleep)  # rank 0 times out meanwhile, then exits
    start = time.time()
    try:
        for _ in range(3):  # rank 1's first call may complete: rank 0 had published its data
            comm.all_reduce(t)
    except PeerUnavailableError as e:
        return {"type": type(e).__name__, "peers": e.peers, "waited": time.time() - start}
    return {"type": None}


def scenario_sleepy_peer(comm, rank, world, store, sleep, rounds):
    """The last rank arrives ``sleep`` s late, ``rounds`` times; the others record what waiting cost them.

    CPU time and voluntary context switches are the whole process's (``getrusage``), from just
    before the call to just after it: a wait that sleeps in the kernel costs neither, one that
    spins, yields or naps in a loop costs CPU time or a wake-up per nap. ``late`` is how long the
    waiter took to leave after the late rank arrived (CLOCK_MONOTONIC is system-wide).
    """
    import resource

    t = torch.ones(1000)
    comm.all_reduce(t)  # both ranks set up
    out = {"cpu": [], "wakeups": [], "waited": [], "arrived": [], "left": []}
    for _ in range(rounds):
        if rank == world - 1:
            time.sleep(sleep)
            out["arrived"].append(time.monotonic())
            comm.all_reduce(t)
            continue
        before, start = resource.getrusage(resource.RUSAGE_SELF), time.monotonic()
        comm.all_reduce(t)
        left, after = time.monotonic(), resource.getrusage(resource.RUSAGE_SELF)
        out["left"].append(left)
        out["waited"].append(left - start)
        out["cpu"].append(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime)
        out["wakeups"].append(after.ru_nvcsw - before.ru_nvcsw)
    out["value"] = t[0].item()
    return out


def scenario_crowded(comm, rank, world, store, busy, deadline):
    """Rank 0 crowds the host with ``busy`` spinning processes (each in a session, so an autogroup,
    of its own, as a second job would be) while the ranks compute and all-reduce; each records where
    the leader put them, and what a child forked while packed gets. The ranks stop together: rank 0
    votes through the all-reduce itself once it has seen packing and forked its child."""
    mask = sorted(os.sched_getaffinity(0))
    out = {"mask": mask, "packed": None, "steps_to_pack": None, "threads": None, "child": None}
    load = []
    if rank == 0:
        # Each spins while this rank lives: one killed at the launch's deadline leaves none behind.
        spin = [sys.executable, "-c", f"import os\nwhile os.getppid() == {os.getpid()}: pass"]
        load = [subprocess.Popen(spin, start_new_session=True) for _ in range(busy)]
    a, b = torch.randn(256, 256), torch.randn(256, 256)
    grads, vote = torch.ones(300_000), torch.zeros(1)
    end, steps = time.monotonic() + deadline, 0

    def look() -> None:  # where the last all-reduce left this rank
        core = comm._placement.core
        if core < 0 or out["packed"] is not None:
            return
        out["packed"], out["steps_to_pack"] = core, steps
        out["threads"] = {t: sorted(os.sched_getaffinity(int(t))) for t in os.listdir("/proc/self/task")}
        if rank == 0:  # a DataLoader worker started now must not inherit the one core
            read, write = os.pipe()
            pid = os.fork()
            if pid == 0:
                os.write(write, json.dumps(sorted(os.sched_getaffinity(0))).encode())
                os._exit(0)
            os.close(write)
            out["child"] = json.loads(os.read(read, 4096))
            os.close(read)
            os.waitpid(pid, 0)

    try:
        while True:
            for _ in range(4):
                a = torch.tanh(a @ b)  # a few ms of compute, like a small model's step
            comm.all_reduce(grads, "mean")
            steps += 1
            look()
            vote[0] = 1.0 if rank == 0 and (out["packed"] is not None or time.monotonic() > end) else 0.0
            comm.all_reduce(vote)  # the peers follow the leader's choice here at the latest
            look()
            if vote[0] > 0:
                break
    finally:
        for p in load:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    comm.close()
    out["after_close"] = sorted(os.sched_getaffinity(0))
    return out


def scenario_mismatch(comm, rank, world, store):
    from phalanx.errors import DistributedRuntimeError

    try:
        comm.all_reduce(torch.ones(10 + rank))
    except DistributedRuntimeError as e:
        return {"type": type(e).__name__, "message": str(e)}
    return {"type": None}


def scenario_tagged_mismatch(comm, rank, world, store):
    from phalanx.errors import CollectiveMismatchError

    # A tag is not part of the match: equal calls with different tags are reduced.
    t = torch.ones(4)
    comm.all_reduce(t, tag=100 + rank)
    agreed = t.tolist()
    # The last rank is one step behind: its small int64 barrier meets its peers' large float32
    # gradient bucket (the chunked path), at step 7 while they are at step 8.
    behind = rank == world - 1
    x = torch.zeros(8, dtype=torch.int64) if behind else torch.ones(300_001)
    start = time.time()
    try:
        comm.all_reduce(x, tag=7 if behind else 8)
    except CollectiveMismatchError as e:
        return {
            "agreed": agreed,
            "type": type(e).__name__,
            "tags": e.tags,
            "calls": [[c["numel"], c["dtype"], c["op"]] for c in e.calls],
            "message": str(e),
            "waited": time.time() - start,
            "closed_after": comm._closed,
        }
    return {"agreed": agreed, "type": None}


def _child_main(args: dict) -> None:
    """Runs each of ``args["scenarios"]`` in turn, each with its own ShmAllReduce (own prefix and
    settings) on the same rank processes; writes every finished scenario's result at once, so what
    a scenario that ends the process (peer death) leaves behind still reaches the test."""
    import faulthandler

    from phalanx.config import stack_signal

    faulthandler.register(stack_signal(), all_threads=True)
    from torch.distributed import TCPStore

    from phalanx.comm.shm import ShmAllReduce

    default_threads = torch.get_num_threads()
    rank, world = args["rank"], args["world"]
    results: dict = {}

    def save() -> None:
        with open(args["out"] + ".tmp", "w") as f:
            json.dump(results, f)
        os.replace(args["out"] + ".tmp", args["out"])

    store = TCPStore("127.0.0.1", args["port"], is_master=False, wait_for_workers=False, timeout=timedelta(seconds=60))
    for sc in args["scenarios"]:
        torch.set_num_threads(sc["threads"] or default_threads)
        try:
            comm = ShmAllReduce(rank, world, store, prefix=sc["prefix"], timeout=sc["timeout"], **sc["kwargs"])
            result = {
                "ok": True,
                "result": globals()[f"scenario_{sc['scenario']}"](comm, rank, world, store, **sc["params"]),
            }
            comm.close()
            comm.close()  # idempotent
        except BaseException as e:  # noqa: BLE001 - reported to the test, which fails with it
            result = {"ok": False, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
        results[sc["name"]] = result
        save()
        if not result["ok"]:
            break  # the peers meet no further scenario: they time out at its rendezvous and say so


# ---------------------------------------------------------------------------- parent side
def _scenario(
    name: str,
    scenario: str,
    *,
    timeout: float = 30.0,
    params: dict | None = None,
    kwargs: dict | None = None,
    threads: int | None = 1,
) -> dict:
    """One scenario of a launch: its own ShmAllReduce (``kwargs``, ``timeout``, its own segment prefix)
    and torch intra-op ``threads`` (None: torch's default)."""
    prefix = f"phxtest{uuid.uuid4().hex[:10]}"
    params = dict(params or {}, **({"prefix": prefix} if scenario == "noncontiguous" else {}))
    return {
        "name": name,
        "scenario": scenario,
        "prefix": prefix,
        "timeout": timeout,
        "params": params,
        "kwargs": kwargs or {},
        "threads": threads,
    }


def _launch_many(
    tmp_path: Path, world: int, scenarios: list[dict], *, deadline: float = 120.0, expect_exit: dict | None = None
) -> tuple[dict[str, list[dict | None]], list[Path]]:
    """Runs ``scenarios`` in turn on ``world`` rank processes; returns {name: each rank's record} and
    the ranks' logs.

    A record is ``{"ok": True, "result": ...}``, ``{"ok": False, "error": ...}``, or None where that
    rank exited (as ``expect_exit`` allows) before reporting it. A rank that exits otherwise than
    ``expect_exit`` says, a missed deadline or a segment left in /dev/shm fails the launch.
    """
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    env = dict(os.environ)
    procs, logs, outs = [], [], []
    try:
        for rank in range(world):
            out, log = tmp_path / f"rank{rank}.json", tmp_path / f"rank{rank}.log"
            args = {"rank": rank, "world": world, "port": store.port, "out": str(out), "scenarios": scenarios}
            logs.append(log)
            outs.append(out)
            with open(log, "w") as f:  # forked from the suite's fork server, as run_job's jobs
                procs.append(start_process([sys.executable, __file__, json.dumps(args)], cwd=tmp_path, env=env, out=f))
        end = time.monotonic() + deadline
        for p in procs:  # rank 0 first: a dead rank 1 stays an unreaped zombie meanwhile
            try:
                p.wait(timeout=max(0.1, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                for q in procs:
                    if q.poll() is None:
                        q.send_signal(stack_signal())
                time.sleep(1.0)
                dumps = "\n".join(f"--- rank {r} ---\n{logs[r].read_text()}" for r in range(world))
                names = [sc["name"] for sc in scenarios]
                pytest.fail(f"{names}: no result within {deadline}s; stacks:\n{dumps}")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        pids = {p.pid for p in procs}
        assert not [c for c in psutil.Process().children(recursive=True) if c.pid in pids]
        left = [sc["name"] for sc in scenarios if _ours(sc["prefix"])]
        assert not left, f"shared segment left in /dev/shm by {left}"
    failures = [
        f"rank {rank} exited {p.returncode}:\n{logs[rank].read_text()}"
        for rank, p in enumerate(procs)
        if p.returncode != (expect_exit or {}).get(rank, 0)
    ]
    assert not failures, "\n".join(failures)
    found = [json.loads(o.read_text()) if o.exists() else {} for o in outs]
    return {sc["name"]: [f.get(sc["name"]) for f in found] for sc in scenarios}, logs


def _results(records: list[dict | None], logs: list[Path], name: str, expect_exit: dict | None = None) -> list:
    """The ranks' results of scenario ``name``; fails naming it if a rank that should report did not."""
    results, failures = [], []
    for rank, rec in enumerate(records):
        if rank in (expect_exit or {}):
            results.append(None)
        elif rec is None:
            failures.append(f"rank {rank} did not report {name}:\n{logs[rank].read_text()}")
        elif not rec["ok"]:
            failures.append(f"rank {rank}, {name}: {rec['error']}\n{rec['traceback']}\n{logs[rank].read_text()}")
        else:
            results.append(rec["result"])
    assert not failures, "\n".join(failures)
    return results


def _launch(
    tmp_path: Path, world: int, scenario: str, *, deadline: float = 120.0, expect_exit: dict | None = None, **kw
) -> list:
    """Runs one scenario in ``world`` fresh processes; returns each rank's result (None: exited)."""
    found, logs = _launch_many(
        tmp_path, world, [_scenario(scenario, scenario, **kw)], deadline=deadline, expect_exit=expect_exit
    )
    return _results(found[scenario], logs, scenario, expect_exit)


def _assert_consistent(results: list[dict]) -> None:
    for rank, r in enumerate(results):
        assert not r["mismatches"], f"rank {rank}: {r['mismatches'][:10]}"
    for rank, r in enumerate(results[1:], 1):
        differ = [k for k in r["digests"] if r["digests"][k] != results[0]["digests"][k]]
        assert not differ, f"rank {rank} differs from rank 0 in {differ[:10]}"


# ---------------------------------------------------------------------------- shared launches
# Most scenarios leave their processes able to go on: they run one after the other on ONE set of
# rank processes per world size (start-up, not the all-reduce, is what a launch costs), each with
# its own ShmAllReduce. A scenario that ends a rank (peer death) comes last.
MATRIX_SIZES = [1, 3, 1023, 1024, 65_537, 262_144, 300_001]  # 4 KB, 1 MB fp32; odd; 2 chunks
PEER_DEATH_CASES = [(2, 1000, False), (2, 4 << 20, False), (2, 16 << 20, True), (3, 1000, False)]
SHARED_PEER_DEATH = {2: PEER_DEATH_CASES[0], 3: PEER_DEATH_CASES[3]}  # the last scenario of each shared launch


def _peer_death(world: int, numel: int, mid_call: bool) -> dict:
    return _scenario(
        f"peer_death {world} {numel} {mid_call}",
        "peer_death",
        params={"dying": world - 1, "numel": numel, "mid_call": mid_call},
    )


def _shared_scenarios(world: int) -> list[dict]:
    matrix = _scenario(f"matrix{world}", "matrix", params={"sizes": MATRIX_SIZES, "dtypes": list(DTYPES)})
    common = [
        matrix,
        _scenario(f"noncontiguous{world}", "noncontiguous"),
        _scenario(f"repeat{world}", "repeat", params={"iterations": 100}),
    ]
    if world == 2:
        own = [
            _scenario("huge", "huge", params={"numel": 16 << 20, "ops": ["sum", "max"]}),
            # torch's default intra-op threads: the torch-math dtypes then work in single-thread pieces.
            _scenario(
                "default_threads",
                "matrix",
                threads=None,
                params={"sizes": [100_003, 300_001], "dtypes": ["float32", "float16", "bfloat16", "int32"]},
            ),
            _scenario("mismatch", "mismatch"),
        ]
    else:
        own = [
            # 64 KiB of segment: 16 KiB steps, so the small path is capped and big tensors take many steps.
            _scenario(
                "small_segment",
                "matrix",
                kwargs={"capacity_bytes": 96 << 10},
                params={"sizes": [5, 4096, 4097, 100_003], "dtypes": ["float32", "bfloat16", "int64"]},
            ),
            _scenario("tagged_mismatch", "tagged_mismatch"),
        ]
    return [*common, *own, _peer_death(*SHARED_PEER_DEATH[world])]


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    """``shared(world, name)``: the ranks' results of scenario ``name`` of the world size's shared
    launch, which starts on first use."""
    done: dict[int, tuple[dict, list[Path]]] = {}
    failed: dict[int, str] = {}

    def get(world: int, name: str, expect_exit: dict | None = None) -> list:
        if world in failed:  # once: the tests after the first do not start it again
            pytest.fail(f"the shared {world}-rank launch failed (see the first test that used it): {failed[world]}")
        if world not in done:
            try:
                done[world] = _launch_many(
                    tmp_path_factory.mktemp(f"shared{world}"),
                    world,
                    _shared_scenarios(world),
                    deadline=400,
                    expect_exit={world - 1: 1},  # the peer-death scenario's dying rank
                )
            except BaseException as e:
                failed[world] = str(e)[:2000]
                raise
        found, logs = done[world]
        return _results(found[name], logs, name, expect_exit)

    return get


# ---------------------------------------------------------------------------- tests
@pytest.mark.parametrize("world", [2, 3])
def test_ops_dtypes_sizes_match_rank_order_reference(shared, world):
    results = shared(world, f"matrix{world}")
    _assert_consistent(results)
    assert len(results[0]["digests"]) == len(MATRIX_SIZES) * len(DTYPES) * len(OPS)


def test_small_segment_chunks_large_tensors(shared):
    _assert_consistent(shared(3, "small_segment"))


def test_64_megabytes(shared):
    _assert_consistent(shared(2, "huge"))


def test_default_torch_threads(shared):
    _assert_consistent(shared(2, "default_threads"))


@pytest.mark.parametrize("world", [2, 3])
def test_noncontiguous_inputs_are_written_back(shared, world):
    results = shared(world, f"noncontiguous{world}")
    _assert_consistent(results)
    if SHM_DIR:  # unlinked once every rank attached; and nothing left after close (in _launch_many)
        assert all(r["left_while_open"] == [] for r in results)


def test_100_repeated_calls_with_jitter(shared):
    _assert_consistent(shared(2, "repeat2"))


def test_100_repeated_calls_three_ranks(shared):
    _assert_consistent(shared(3, "repeat3"))


@pytest.mark.parametrize("world,numel,mid_call", PEER_DEATH_CASES)
def test_peer_death_raises_peer_unavailable(tmp_path, shared, world, numel, mid_call):
    dying = world - 1
    if (world, numel, mid_call) == SHARED_PEER_DEATH[world]:
        results = shared(world, f"peer_death {world} {numel} {mid_call}", expect_exit={dying: 1})
    else:
        sc = _peer_death(world, numel, mid_call)
        found, logs = _launch_many(tmp_path, world, [sc], expect_exit={dying: 1})
        results = _results(found[sc["name"]], logs, sc["name"], expect_exit={dying: 1})
    for rank, r in enumerate(results):
        if rank == dying:
            continue
        assert r["type"] == "PeerUnavailableError", r
        assert r["peers"] == [f"rank {dying}"], r
        assert r["delay"] < 2.0, r
        assert r["closed_after"], r


def test_stalled_peer_raises_collective_timeout(tmp_path):
    results = _launch(tmp_path, 2, "stall", timeout=1.0, params={"sleep": 4.0})
    assert results[0]["type"] == "CollectiveTimeoutError", results
    assert results[0]["peers"] == ["rank 1"]
    assert 0.9 < results[0]["waited"] < 3.0, results
    # Rank 0 has exited by the time rank 1 arrives: rank 1 sees a dead peer, not a hang.
    assert results[1]["type"] == "PeerUnavailableError", results
    assert results[1]["peers"] == ["rank 0"]


@pytest.mark.parametrize("world", [2, 3])
def test_a_waiting_rank_sleeps_in_the_kernel_and_wakes_at_once(tmp_path, world):
    # Issue 33: a rank that waits for a late peer gives its core back (a peer that lost its core
    # to a busy neighbour must get it) and is woken by the peer's arrival, not by polling.
    results = _launch(tmp_path, world, "sleepy_peer", params={"sleep": 1.0, "rounds": 2})
    late = results[-1]
    for rank, r in enumerate(results[:-1]):
        assert r["value"] == world**3, r  # setup + 2 rounds, each multiplying by ``world``
        for i in range(2):
            assert 0.9 < r["waited"][i] < 3.0, r
            # Spinning, yielding or napping for 1 s costs tens of ms of CPU and a wake-up per nap.
            assert r["cpu"][i] < 0.015, f"rank {rank} used {r['cpu'][i] * 1e3:.1f} ms of CPU waiting 1 s: {r}"
            assert r["wakeups"][i] < 40, f"rank {rank} woke {r['wakeups'][i]} times waiting 1 s: {r}"
            # ... and it leaves promptly once the late rank arrives (a futex wake, not a timeout).
            assert r["left"][i] - late["arrived"][i] < 0.05, (rank, r, late)


def test_wait_statistics_say_where_a_wait_went(tmp_path):
    # Issue 33's diagnosis: asked to (stats_dir, record_wait_stats), each rank writes at close how
    # many waits it made, how long they took, how much CPU they cost and how long it slept.
    stats = tmp_path / "stats"
    results = _launch(tmp_path, 2, "sleepy_peer", params={"sleep": 0.5, "rounds": 2}, kwargs={"stats_dir": str(stats)})
    files = {json.loads(p.read_text())["rank"]: json.loads(p.read_text()) for p in stats.glob("shm-*-rank*.json")}
    assert sorted(files) == [0, 1], list(stats.iterdir())
    waiter = files[0]
    assert waiter["world_size"] == 2 and waiter["pid"] != files[1]["pid"]
    assert waiter["waits"] >= 2 and sum(waiter["histogram_us"]) == waiter["waits"], waiter
    assert waiter["histogram_us"][-1] >= 2, waiter  # the two late rounds took >= 100 ms
    assert waiter["past_spin"] >= 2 and waiter["sleeps"] >= 2, waiter
    assert 0.9 <= waiter["wait_s"] < 3.0 and waiter["longest_s"] >= 0.45, waiter
    assert 0.8 <= waiter["sleep_s"] <= waiter["wait_s"], waiter  # asleep for most of it ...
    assert waiter["wait_cpu_s"] < 0.05, waiter  # ... so the waits cost it almost no CPU
    assert waiter["spin_s"] <= waiter["past_spin"] * 0.0021 + 0.01, waiter  # each wait spins <= 2 ms
    assert sum(results[0]["waited"]) <= waiter["wait_s"] + 0.1, (results[0], waiter)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="packing needs two cores")
def test_a_crowded_host_packs_the_replicas_on_one_core_and_gives_their_cores_back(tmp_path):
    # Issue 33: replicas on a host crowded by other programs run together on one core (a replica
    # that waits hands its core to its peer, not to the neighbour), every thread of the process
    # moves, a forked child gets the original mask, and closing gives it back.
    busy = 2 * len(os.sched_getaffinity(0))
    results = _launch(tmp_path, 2, "crowded", params={"busy": busy, "deadline": 60.0}, deadline=120.0)
    for rank, r in enumerate(results):
        assert r["packed"] is not None, f"rank {rank} was never packed beside {busy} busy processes: {r}"
        assert r["packed"] in r["mask"], r
        assert all(m == [r["packed"]] for m in r["threads"].values()), f"rank {rank}: {r['threads']}"
        assert r["after_close"] == r["mask"], f"rank {rank} kept {r['after_close']} after close: {r}"
    assert results[0]["packed"] == results[1]["packed"], results  # one core for both
    assert results[0]["child"] == results[0]["mask"], results[0]


def test_mismatched_tensors_raise_instead_of_corrupting(shared):
    results = shared(2, "mismatch")
    assert [r["type"] for r in results] == ["DistributedRuntimeError"] * 2, results


def test_a_tagged_mismatch_names_every_ranks_call_and_tag(shared):
    # What the CentralStorage strategy turns into a ReplicaDivergenceError naming both steps.
    results = shared(3, "tagged_mismatch")
    for r in results:
        assert r["agreed"] == [3.0] * 4, r
        assert r["type"] == "CollectiveMismatchError", r
        assert r["tags"] == [8, 8, 7], r
        assert r["calls"] == [[300_001, "float32", "sum"]] * 2 + [[8, "int64", "sum"]], r
        assert "tag=7" in r["message"] and "tag=8" in r["message"], r
        assert r["waited"] < 2.0 and r["closed_after"], r


# ---------------------------------------------------------------------------- in-process tests
def test_rendezvous_timeout_names_missing_rank_and_cleans_up():
    from torch.distributed import TCPStore

    from phalanx.comm.shm import ShmAllReduce
    from phalanx.errors import RendezvousTimeoutError

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=1))
    prefix = f"phxtest{uuid.uuid4().hex[:10]}"
    with pytest.raises(RendezvousTimeoutError) as info:
        ShmAllReduce(0, 2, store, prefix=prefix)
    assert info.value.missing == ["rank 1"]
    assert not _ours(prefix)


def test_single_process_and_argument_errors():
    from phalanx.comm.shm import ShmAllReduce

    comm = ShmAllReduce(0, 1, store=None)
    t = torch.arange(6.0).view(2, 3)
    assert comm.all_reduce(t, "mean") is t and torch.equal(t, torch.arange(6.0).view(2, 3))
    with pytest.raises(ValueError):
        comm.all_reduce(t, "median")
    with pytest.raises(TypeError):
        comm.all_reduce(torch.zeros(2, dtype=torch.complex64))
    comm.close()
    comm.close()
    with pytest.raises(ValueError):
        ShmAllReduce(2, 2, store=None)


if __name__ == "__main__":
    _child_main(json.loads(sys.argv[1]))
