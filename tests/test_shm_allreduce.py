"""Multi-process tests of phalanx.comm.shm.ShmAllReduce.

Each test starts real processes (this file run as a script, one per rank) that meet through a
real TCPStore hosted by the test process. Every launch has a hard deadline: on expiry each child
dumps its Python stacks (faulthandler on SIGUSR1) and is killed, and the test fails with the
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

SRC = str(Path(__file__).resolve().parents[1] / "src")
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
    import faulthandler

    faulthandler.register(signal.SIGUSR1, all_threads=True)
    if args.get("threads"):
        torch.set_num_threads(args["threads"])
    from torch.distributed import TCPStore

    from phalanx.comm.shm import ShmAllReduce

    rank, world = args["rank"], args["world"]
    result: dict = {}
    try:
        store = TCPStore(
            "127.0.0.1", args["port"], is_master=False, wait_for_workers=False, timeout=timedelta(seconds=60)
        )
        comm = ShmAllReduce(
            rank, world, store, prefix=args["prefix"], timeout=args["timeout"], **args.get("kwargs", {})
        )
        result = {
            "ok": True,
            "result": globals()[f"scenario_{args['scenario']}"](comm, rank, world, store, **args.get("params", {})),
        }
        comm.close()
        comm.close()  # idempotent
    except BaseException as e:  # noqa: BLE001 - reported to the test, which fails with it
        result = {"ok": False, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
    with open(args["out"], "w") as f:
        json.dump(result, f)


# ---------------------------------------------------------------------------- parent side
def _launch(
    tmp_path: Path,
    world: int,
    scenario: str,
    *,
    deadline: float = 120.0,
    timeout: float = 30.0,
    params: dict | None = None,
    kwargs: dict | None = None,
    threads: int | None = 1,
    expect_exit: dict | None = None,
) -> list[dict]:
    """Runs `scenario` in `world` processes; returns each rank's result dict."""
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    prefix = f"phxtest{uuid.uuid4().hex[:10]}"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")]))
    procs, logs, outs = [], [], []
    try:
        for rank in range(world):
            out, log = tmp_path / f"rank{rank}.json", tmp_path / f"rank{rank}.log"
            args = {
                "rank": rank,
                "world": world,
                "port": store.port,
                "prefix": prefix,
                "scenario": scenario,
                "timeout": timeout,
                "out": str(out),
                "params": dict(params or {}, **({"prefix": prefix} if scenario == "noncontiguous" else {})),
                "kwargs": kwargs or {},
                "threads": threads,
            }
            logs.append(log)
            outs.append(out)
            with open(log, "w") as f:
                procs.append(
                    subprocess.Popen(
                        [sys.executable, __file__, json.dumps(args)], stdout=f, stderr=subprocess.STDOUT, env=env
                    )
                )
        end = time.monotonic() + deadline
        for p in procs:  # rank 0 first: a dead rank 1 stays an unreaped zombie meanwhile
            try:
                p.wait(timeout=max(0.1, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                for q in procs:
                    if q.poll() is None:
                        q.send_signal(signal.SIGUSR1)
                time.sleep(1.0)
                dumps = "\n".join(f"--- rank {r} ---\n{logs[r].read_text()}" for r in range(world))
                pytest.fail(f"{scenario}: no result within {deadline}s; stacks:\n{dumps}")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        pids = {p.pid for p in procs}
        assert not [c for c in psutil.Process().children(recursive=True) if c.pid in pids]
        assert not _ours(prefix), "shared segment left in /dev/shm"
    results, failures = [], []
    for rank, p in enumerate(procs):
        want = (expect_exit or {}).get(rank, 0)
        if p.returncode != want:
            failures.append(f"rank {rank} exited {p.returncode}:\n{logs[rank].read_text()}")
        elif want == 0:
            res = json.loads(outs[rank].read_text())
            if not res["ok"]:
                failures.append(f"rank {rank}: {res['error']}\n{res['traceback']}\n{logs[rank].read_text()}")
            results.append(res.get("result"))
        else:
            results.append(None)
    assert not failures, "\n".join(failures)
    return results


def _assert_consistent(results: list[dict]) -> None:
    for rank, r in enumerate(results):
        assert not r["mismatches"], f"rank {rank}: {r['mismatches'][:10]}"
    for rank, r in enumerate(results[1:], 1):
        differ = [k for k in r["digests"] if r["digests"][k] != results[0]["digests"][k]]
        assert not differ, f"rank {rank} differs from rank 0 in {differ[:10]}"


# ---------------------------------------------------------------------------- tests
@pytest.mark.parametrize("world", [2, 3])
def test_ops_dtypes_sizes_match_rank_order_reference(tmp_path, world):
    sizes = [1, 3, 1023, 1024, 65_537, 262_144, 300_001]  # 4 KB, 1 MB fp32; odd; 2 chunks
    results = _launch(tmp_path, world, "matrix", params={"sizes": sizes, "dtypes": list(DTYPES)})
    _assert_consistent(results)
    assert len(results[0]["digests"]) == len(sizes) * len(DTYPES) * len(OPS)


def test_small_segment_chunks_large_tensors(tmp_path):
    # 64 KiB of segment: 16 KiB steps, so the small path is capped and big tensors take many steps.
    results = _launch(
        tmp_path,
        3,
        "matrix",
        kwargs={"capacity_bytes": 96 << 10},
        params={"sizes": [5, 4096, 4097, 100_003], "dtypes": ["float32", "bfloat16", "int64"]},
    )
    _assert_consistent(results)


def test_64_megabytes(tmp_path):
    results = _launch(tmp_path, 2, "huge", deadline=240, params={"numel": 16 << 20, "ops": ["sum", "max"]})
    _assert_consistent(results)


def test_default_torch_threads(tmp_path):
    # torch's default intra-op threads: the torch-math dtypes then work in single-thread pieces.
    results = _launch(
        tmp_path,
        2,
        "matrix",
        threads=None,
        params={"sizes": [100_003, 300_001], "dtypes": ["float32", "float16", "bfloat16", "int32"]},
    )
    _assert_consistent(results)


@pytest.mark.parametrize("world", [2, 3])
def test_noncontiguous_inputs_are_written_back(tmp_path, world):
    results = _launch(tmp_path, world, "noncontiguous")
    _assert_consistent(results)
    if SHM_DIR:  # unlinked once every rank attached; and nothing left after close (in _launch)
        assert all(r["left_while_open"] == [] for r in results)


def test_100_repeated_calls_with_jitter(tmp_path):
    _assert_consistent(_launch(tmp_path, 2, "repeat", params={"iterations": 100}))


def test_100_repeated_calls_three_ranks(tmp_path):
    _assert_consistent(_launch(tmp_path, 3, "repeat", params={"iterations": 100}))


@pytest.mark.parametrize(
    "world,numel,mid_call", [(2, 1000, False), (2, 4 << 20, False), (2, 16 << 20, True), (3, 1000, False)]
)
def test_peer_death_raises_peer_unavailable(tmp_path, world, numel, mid_call):
    dying = world - 1
    results = _launch(
        tmp_path,
        world,
        "peer_death",
        expect_exit={dying: 1},
        params={"dying": dying, "numel": numel, "mid_call": mid_call},
    )
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


def test_mismatched_tensors_raise_instead_of_corrupting(tmp_path):
    results = _launch(tmp_path, 2, "mismatch")
    assert [r["type"] for r in results] == ["DistributedRuntimeError"] * 2, results


def test_a_tagged_mismatch_names_every_ranks_call_and_tag(tmp_path):
    # What the CentralStorage strategy turns into a ReplicaDivergenceError naming both steps.
    results = _launch(tmp_path, 3, "tagged_mismatch")
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
