"""The background load of ``python -m benchmarks --load`` (issue 33): it runs, and it ends."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent


def _bench():
    sys.path.insert(0, str(ROOT))
    try:
        import benchmarks.__main__ as bench
        import benchmarks.load as load
    finally:
        sys.path.remove(str(ROOT))
    return bench, load


def test_the_load_keeps_the_cores_busy_and_leaves_no_process_behind():
    _, load = _bench()
    with load.BackgroundLoad(busy=1, dataloader_workers=2) as running:
        leaders = [psutil.Process(p.pid) for p in running._procs]
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and len(leaders[1].children()) < 2:  # the DataLoader's workers
            time.sleep(0.2)
        everyone = leaders + leaders[1].children()
        assert len(everyone) == 4, everyone  # one busy process, the DataLoader and its 2 workers
        busy = sum(p.cpu_times().user for p in everyone)
        time.sleep(1.0)
        assert sum(p.cpu_times().user for p in everyone) - busy > 0.3, "the load does not use the CPU"
    gone, alive = psutil.wait_procs(everyone, timeout=10)
    assert not alive, alive


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
