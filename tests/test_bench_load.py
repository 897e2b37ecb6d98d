"""The background load of ``python -m benchmarks --load`` (issue 33): it runs, and it ends."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parent.parent


def _bench():
    sys.path.insert(0, str(ROOT))
    try:
        import benchmarks.__main__ as bench
        import benchmarks.load as load
    finally:
        sys.path.remove(str(ROOT))
    return bench, load


def test_the_load_is_at_work_when_the_job_starts_says_what_it_took_and_leaves_no_process_behind():
    _, load = _bench()
    with load.BackgroundLoad(busy=1, dataloader_workers=2) as running:
        # At entry, not some time later: the DataLoader's workers have delivered a batch.
        leaders = [psutil.Process(p.pid) for p in running._procs]
        everyone = leaders + leaders[1].children()
        assert len(everyone) == 4, everyone  # one busy process, the DataLoader and its 2 workers
        busy = sum(p.cpu_times().user for p in everyone)
        time.sleep(1.0)
        assert sum(p.cpu_times().user for p in everyone) - busy > 0.3, "the load does not use the CPU"
    # 3 processes spinning (the busy one, 2 workers) on this host's cores, beside this test.
    assert running.cores is not None and running.cores > 0.5, running.cores
    gone, alive = psutil.wait_procs(everyone, timeout=10)
    assert not alive, alive


def test_a_load_process_that_dies_before_it_is_at_work_is_a_typed_error(monkeypatch):
    _, load = _bench()
    monkeypatch.setattr(load.sys, "executable", "/bin/false")
    with pytest.raises(RuntimeError, match="exited with 1 before it was at work"):
        with load.BackgroundLoad(busy=1, dataloader_workers=0):
            pass


def test_the_summary_says_which_figures_were_taken_under_load():
    bench, load = _bench()
    ratio = {"median": 1.2, "min": 1.1, "max": 1.3}
    report = {
        "throughput": {"ratios": {"large_mlp": {"px_mirrored_vs_ddp": ratio}}},
        "loaded": {"load": load.DESCRIPTION, "ratios": {"large_mlp": {"px_mirrored_vs_ddp": ratio}}},
        "elapsed_s": 1.0,
    }
    lines = bench.summary(report).splitlines()
    assert any("px_mirrored_vs_ddp" in line and "idle" in line for line in lines), lines
    assert any("px_mirrored_vs_ddp" in line and "loaded" in line for line in lines), lines
    assert any(load.DESCRIPTION in line for line in lines), lines
    assert "--load" in bench.build_parser().format_help()


def test_a_loaded_figure_is_the_mean_of_several_shorter_jobs(monkeypatch):
    """One loaded job per round compared where the kernel put the replicas more than the libraries
    (benchmarks/load_diag.py): a loaded figure is now the mean of --load-jobs jobs of
    --seconds / N, each under its own load, with every job's figure kept. (Pure logic: the jobs
    and the load are stand-ins here; test_the_load_is_at_work_when_the_job_starts... runs the real load.)"""
    import itertools

    bench, _ = _bench()
    runs: list[tuple[str, float, bool]] = []
    values = itertools.count(100, 100)
    under_load = [False]

    class fake_load:
        cores = 1.5

        def __enter__(self):
            under_load[0] = True
            return self

        def __exit__(self, *exc):
            under_load[0] = False

    def fake_job(cmd, out):
        runs.append((cmd[0], float(cmd[-1]), under_load[0]))
        return {"samples_per_s": float(next(values))}

    monkeypatch.setattr(bench, "_job", fake_job)
    monkeypatch.setattr(bench, "BackgroundLoad", fake_load)

    def command(config):
        return lambda m, out, s: [config, m, out, "--seconds", s]

    configs = {c: command(c) for c in ("px", "ddp")}
    loaded, per_job, cores = {}, {}, {}
    idle = bench._interleaved(
        configs, ["mlp"], 2, 2.0, loaded=loaded, load_jobs=4, loaded_jobs=per_job, load_cores=cores
    )
    assert sorted((c, s, load) for c, s, load in runs) == sorted(
        [(c, 2.0, False) for c in ("px", "ddp") for _ in range(2)]
        + [(c, 0.5, True) for c in ("px", "ddp") for _ in range(8)]
    )
    assert [len(idle["mlp"][c]) for c in ("px", "ddp")] == [2, 2]
    for c in ("px", "ddp"):
        jobs = per_job["mlp"][c]
        assert len(jobs) == 8 and loaded["mlp"][c] == [sum(jobs[:4]) / 4, sum(jobs[4:]) / 4]
        assert cores["mlp"][c] == [1.5] * 8
    assert "--load-jobs" in bench.build_parser().format_help()
