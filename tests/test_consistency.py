"""Replicas that cannot drift apart (issue 13 cases 1-4), in real processes on both collective paths.

Accumulation: 2 and 4 micro-batches, SGD-momentum and Adam, Mirrored x2/x3, CentralStorage x2,
MWMS 2 workers, within 1e-5 of one device. Divergence: the typed error on every replica within one
step and 2 s, over the shared-memory path (default) and gloo (``PHALANX_SHM=0``).
"""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest
import torch

from conftest import free_ports, jobs_on_first_use, run_job, run_jobs, tf_config

SCRIPT = Path(__file__).parent / "scripts" / "consistency.py"


def _load(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path, weights_only=True)


def _load_script():
    spec = importlib.util.spec_from_file_location("_consistency_script", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def references():
    """Plain PyTorch on one device: computed here, it needs no process of its own (fork_rng: it
    seeds the global generator, which the tests after it must not see). Module scope puts it before
    any test's hygiene snapshot: Adam's first step sets TORCHINDUCTOR_CACHE_DIR once per process."""
    with torch.random.fork_rng(devices=[]):
        return _load_script().references()


def _check(out: Path, world: int, reference: dict) -> float:
    replicas = [_load(out / f"params_{r}.pt") for r in range(world)]
    for other in replicas[1:]:
        assert all(torch.equal(replicas[0][k], other[k]) for k in replicas[0]), "replicas diverged"
    return max(float((replicas[0][k] - reference[k]).abs().max()) for k in reference)


ACCUMULATE_CASES = [
    ("mirrored", 2, "sgd", 2, "plain"),
    ("mirrored", 2, "adam", 4, "plain"),
    ("mirrored", 3, "sgd", 4, "plain"),
    ("mirrored", 3, "adam", 2, "no_sync"),
    ("mirrored", 2, "sgd", 4, "no_sync"),
    ("central", 2, "sgd", 2, "plain"),
    ("central", 2, "adam", 4, "no_sync"),
    # Fine-tuning: a layer created frozen and unfrozen later has its gradients summed from then
    # on (they were not: the replicas drifted apart), and one frozen later is left alone (it
    # was moved by a zero gradient's momentum).
    ("mirrored", 2, "sgd", 2, "thaw"),
    ("central", 2, "sgd", 2, "thaw"),
]
MWMS_CASES = [("sgd", 2, "plain"), ("adam", 4, "no_sync")]


def _case(kind: str, opt: str, micro: int, mode: str) -> str:
    return f"{kind},{opt},{micro},{mode}"


@pytest.fixture(scope="module")
def accumulate_runs(tmp_path_factory):
    """{world: folder}: every case on N local replicas in ONE job, Mirrored and CentralStorage one
    after the other on the same N processes (start-up, not training, is what a case costs); each
    world size's job started on first use. A job that fails names its failing case (CASE lines)."""

    def command(n: int, out: Path) -> list[str]:
        cases = [_case(k, o, m, mode) for k, w, o, m, mode in ACCUMULATE_CASES if w == n]
        return [sys.executable, str(SCRIPT), "accumulate", str(out), str(n), *cases]

    return jobs_on_first_use(tmp_path_factory, "accumulate_x", command, timeout=240)


@pytest.fixture(scope="module")
def mwms_accumulate_run(tmp_path_factory):
    """Both MWMS cases in one two-worker job, one after the other."""
    out = tmp_path_factory.mktemp("accumulate_mwms")
    workers = [f"127.0.0.1:{p}" for p in free_ports(2)]
    cases = [_case("mwms", o, m, mode) for o, m, mode in MWMS_CASES]
    jobs = [
        ([sys.executable, str(SCRIPT), "accumulate", str(out), "2", *cases], tf_config(workers, i)) for i in range(2)
    ]
    results = run_jobs(jobs, timeout=180, cwd=out)
    assert all(r.returncode == 0 for r in results), [r.output for r in results]
    return out


@pytest.mark.parametrize("kind,n,opt,micro,mode", ACCUMULATE_CASES)
def test_accumulated_gradients_match_one_device(accumulate_runs, references, kind, n, opt, micro, mode):
    case = _case(kind, opt, micro, mode)
    folder = accumulate_runs(n) / case
    assert (folder / "params_0.pt").exists(), f"case {case} x{n} wrote no result"
    diff = _check(folder, n, references[(opt, micro, "thaw") if mode == "thaw" else (opt, micro)])
    print(f"\n{kind} x{n} {opt} {micro} micro-batches ({mode}): max |param - one-device param| = {diff:.3g}")
    assert diff < 1e-5, f"case {case} x{n}: max diff {diff:.3g}"


@pytest.mark.parametrize("opt,micro,mode", MWMS_CASES)
def test_accumulated_gradients_match_one_device_two_workers(mwms_accumulate_run, references, opt, micro, mode):
    case = _case("mwms", opt, micro, mode)
    folder = mwms_accumulate_run / case
    assert (folder / "params_0.pt").exists(), f"case {case} wrote no result"
    diff = _check(folder, 2, references[opt, micro])
    print(f"\nMWMS 2 workers {opt} {micro} micro-batches ({mode}): max diff {diff:.3g}")
    assert diff < 1e-5, f"case {case}: max diff {diff:.3g}"


_MARK = re.compile(r"DIVERGED (\S+) (\d+) ([\d.]+) ([\d.]+) (\w+): (.*)")


_CASES = [
    ("skip", "step"),
    ("outside_scope", "created outside strategy.scope()"),
    ("batch_size", "global batch size"),
    ("restore", "parameters"),
]


# Mirrored: every case on both collective paths, the loop also calling strategy.reduce.
# CentralStorage: the gradients go to replica 0 only, and the loop calls no strategy.reduce, so
# only the guard's own collectives can catch the divergence (on shared memory; the skipped step,
# where the pairing of collectives matters, on gloo too). Its restore case is below.
DIVERGENCE_CASES = (
    [("mirrored", shm, *c) for shm in ("1", "0") for c in _CASES]
    + [("central", "1", *c) for c in _CASES[:3]]
    + [("central", "0", *_CASES[0])]
)
CENTRAL_RESTORE = "restore,central,noreduce"


def _label(kind: str, case: str) -> str:
    return f"{case},{kind},{'reduce' if kind == 'mirrored' else 'noreduce'}"


@pytest.fixture(scope="module")
def divergence_jobs(tmp_path_factory):
    """{shm: job}: every divergence case of one collective path in ONE two-replica job, one after the
    other on the same processes, each with a fresh strategy (a case that diverged closes its strategy;
    the job re-raises the first divergence at its end); the shared-memory job ends with the
    CentralStorage restore case, which must not diverge. Each job is started on first use."""
    done = {}

    def run(shm: str):
        if shm not in done:
            cwd = tmp_path_factory.mktemp(f"diverge_shm{shm}")
            labels = [_label(kind, case) for kind, s, case, _ in DIVERGENCE_CASES if s == shm]
            labels += [CENTRAL_RESTORE] if shm == "1" else []
            done[shm] = run_job(
                [sys.executable, str(SCRIPT), "diverge-many", "2", *labels],
                timeout=240,
                cwd=cwd,
                env={"PHALANX_SHM": shm},
            )
        return done[shm]

    return run


@pytest.mark.parametrize("kind,shm,case,field", DIVERGENCE_CASES)
def test_divergence_raises_on_every_replica_within_a_step(divergence_jobs, kind, case, field, shm):
    res = divergence_jobs(shm)
    label = _label(kind, case)
    logs = res.logs()
    assert res.returncode != 0, logs  # the job fails as one that stopped at its first divergence
    marks = {int(m.group(2)): m for m in _MARK.finditer(logs) if m.group(1) == label}
    assert set(marks) == {0, 1}, f"case {label}: not caught on every replica\n{logs[-5000:]}"
    # The divergence exists once both replicas reached the step where it starts (they may start
    # their loops at different times); a replica that detects it alone is timed from its own step.
    began = max(float(m.group(4)) for m in marks.values())
    for m in marks.values():
        assert m.group(5) in ("ReplicaDivergenceError", "UnsynchronizedParameterError"), label
        elapsed = float(m.group(3)) - (float(m.group(4)) if case == "outside_scope" else began)
        print(
            f"\ntime-to-error {kind} {case} (shm={shm}): replica {m.group(2)} raised {elapsed * 1000:.0f} ms after the divergence: "
            f"{m.group(6)[:160]}"
        )
        assert elapsed < 2.0, label
    if field == "parameters":
        assert "Linear.bias (shape (1,))" in marks[0].group(6), label
    else:
        assert field in marks[0].group(6), label


@pytest.fixture(scope="module")
def central_restore_job(divergence_jobs):
    """CentralStorage x2, replica 1 "restoring" other values at step 3; then one step counted with
    the guard on and one with it off: the last case of the shared-memory divergence job."""
    res = divergence_jobs("1")
    logs = res.logs()
    done = set(re.findall(rf"CASE {re.escape(CENTRAL_RESTORE)} done (\d)", logs))
    # Each replica ended the case normally (no error of any kind: the job would have stopped there).
    assert done == {"0", "1"}, logs[-5000:]
    return logs


def test_a_restore_on_one_replica_cannot_diverge_under_central_storage(central_restore_job):
    # CentralStorage keeps one shared copy of the trainable variables: what replica 1 writes into
    # them (the restore case's "restore" on replica 1 only) is what replica 0 reads, so the
    # fingerprints after mark_parameters_changed() agree and training ends with equal parameters.
    logs = central_restore_job
    ends = dict(re.findall(rf"NOT DIVERGED {re.escape(CENTRAL_RESTORE)} (\d) (\S+)", logs))
    assert set(ends) == {"0", "1"} and ends["0"] == ends["1"], logs[-3000:]


def test_the_guard_adds_no_collective_under_central_storage_on_shared_memory(central_restore_job):
    # On one host the gradient buckets are all-reduced through shared memory (every replica gets
    # the sum), so the guard rides on the first one as under Mirrored: a step with the guard on
    # runs the same collectives as one with it off: the two barriers and the bucket.
    logs = central_restore_job
    counts = {
        int(r): json.loads(c) for r, c in re.findall(rf"COLLECTIVES {re.escape(CENTRAL_RESTORE)} (\d) (\{{.*\}})", logs)
    }
    assert set(counts) == {0, 1}, logs[-3000:]
    for rank, per_step in counts.items():
        assert per_step["on"] == per_step["off"] == {"all_reduce": 3, "reduce": 0}, (rank, per_step)


def test_different_global_batch_per_worker_is_caught(tmp_path):
    workers = [f"127.0.0.1:{p}" for p in free_ports(2)]
    jobs = [
        ([sys.executable, str(SCRIPT), "diverge", "batch_size", "mwms", "2"], tf_config(workers, i)) for i in range(2)
    ]
    results = run_jobs(jobs, timeout=90, cwd=tmp_path)
    for r in results:
        assert r.returncode != 0
        m = _MARK.search(r.output)
        assert m is not None and "global batch size is 24" in m.group(6) and "but 48" in m.group(6), r.output[-3000:]
        took = float(m.group(3)) - float(m.group(4))
        print(f"\ntime-to-error mwms batch_size: worker {m.group(2)} raised {took * 1000:.0f} ms after its first step")
        assert took < 2.0


def test_with_the_gpu_cadence_a_skipped_step_is_raised_on_every_replica_at_the_next_check(tmp_path):
    # PHALANX_GUARD_EVERY=3, a GPU's way of checking (every 8th pass by default there), on CPU
    # replicas: replica 1 skips step 2 (a caught exception); passes 1, 4, 7, ... carry the fields,
    # so both replicas raise at replica 0's step 4 rather than 3, the same error; a global batch
    # of another size is raised at the first pass. Without the strategy.reduce of each step: its
    # own check would come first.
    res = run_job(
        [sys.executable, str(SCRIPT), "diverge-many", "2", "skip,mirrored,noreduce", "batch_size,mirrored,noreduce"],
        timeout=120,
        cwd=tmp_path,
        env={"PHALANX_SHM": "1", "PHALANX_GUARD_EVERY": "3"},
    )
    logs = res.logs()
    assert res.returncode != 0, logs
    for label, said in (
        ("skip,mirrored,noreduce", "diverged at step 4: step is 4 on replica:0 (rank 0) but 5 on replica:1"),
        ("batch_size,mirrored,noreduce", "diverged at step 1: global batch size is 24 on replica:0"),
    ):
        marks = {int(m.group(2)): m.group(6) for m in _MARK.finditer(logs) if m.group(1) == label}
        assert set(marks) == {0, 1}, f"case {label}: not caught on every replica\n{logs[-5000:]}"
        assert all(said in message for message in marks.values()), (label, marks)
