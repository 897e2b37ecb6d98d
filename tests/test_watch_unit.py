"""phalanx.progress, phalanx.profile and the job report in one process (the jobs: tests/test_watch_job.py)."""

from __future__ import annotations

import io
import json
import sys

import pytest
import torch

import phalanx as px
from phalanx import report, summary
from phalanx.comm.timing import MARKS
from phalanx.errors import ProfileError, ProgressError
from phalanx.progress_bar import choose_style


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


# ------------------------------------------------------------------------------ progress
def test_without_a_tty_the_bar_is_plain_lines_every_interval_and_one_at_the_end():
    out = io.StringIO()
    bar = px.progress(range(5), desc="epoch 1", batch_size=32, file=out, interval=3600)
    for i in bar:
        bar.set_postfix(loss=torch.tensor(1.0 / (i + 1)))
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue()
    # The first step's line, then nothing for an hour, then the last state at the end.
    assert [line.split(",")[0] for line in lines] == ["epoch 1: step 1/5 (20%)", "epoch 1: step 5/5 (100%)"]
    assert "samples/s" in lines[1] and "0:00:00 left" in lines[1] and "loss=0.2" in lines[1]
    assert bar.n == 5 and bar.samples == 160


def test_the_bar_counts_global_batches_of_a_distributed_dataset():
    strategy = px.OneDeviceStrategy("cpu")
    data = [torch.ones(8, 2) for _ in range(3)]
    out = io.StringIO()
    bar = px.progress(strategy.experimental_distribute_dataset(data), file=out, interval=0)
    for x in bar:
        strategy.run(lambda t: t.sum(), args=(x,))
    assert bar.samples == 24 and bar.total == 3
    assert len(out.getvalue().splitlines()) == 3


def test_on_a_terminal_tqdm_draws_the_bar_with_the_jobs_numbers():
    pytest.importorskip("tqdm")
    out = _Tty()
    bar = px.progress(range(4), desc="train", batch_size=16, file=out)
    assert bar.style == "tqdm"
    for _ in bar:
        bar.set_postfix(loss=0.5)
    text = out.getvalue()
    assert "\r" in text and "train" in text and "4/4" in text and "loss=0.5" in text and "samples/s" in text


def test_rich_draws_the_bar_where_asked():
    pytest.importorskip("rich")
    out = _Tty()
    bar = px.progress(range(3), desc="train", batch_size=16, file=out, style="rich")
    for _ in bar:
        bar.set_postfix(loss=0.25)
    assert "3/3" in out.getvalue() and "loss=0.25" in out.getvalue()


def test_progress_bad_input_is_typed():
    with pytest.raises(ProgressError, match="Unknown progress style 'fancy'"):
        px.progress(range(2), style="fancy")
    bar = px.progress(range(2), file=io.StringIO())
    with pytest.raises(ProgressError, match="per-replica value") as e:
        bar.set_postfix(loss=px.PerReplica((1.0, 2.0)))
    assert "strategy.reduce" in e.value.hint


def test_a_missing_bar_client_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "tqdm", None)
    with pytest.raises(ProgressError, match="needs the 'tqdm' package") as e:
        choose_style("tqdm", _Tty())
    assert ".[progress]" in e.value.hint
    monkeypatch.setitem(sys.modules, "rich", None)
    assert choose_style(None, _Tty()) == "plain"  # nothing to draw with: plain lines, not an error


def test_a_replica_that_is_not_the_chief_prints_nothing(monkeypatch):
    import phalanx.core.process as process

    monkeypatch.setattr(process, "identity", lambda: process.ProcessIdentity(1, 2, False, "environment"))
    out = io.StringIO()
    items = list(px.progress(range(3), file=out, interval=0))
    assert items == [0, 1, 2] and out.getvalue() == ""


# ------------------------------------------------------------------------------ profile
def test_a_profile_records_the_steps_asked_and_marks_collectives(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))  # torch.profiler's first use sets it
    strategy = px.OneDeviceStrategy("cpu")
    model = torch.nn.Linear(4, 4)
    with px.profile(tmp_path, steps=(2, 3)) as prof:
        for _ in range(5):
            assert prof.recording == (strategy.extended.step + 1 in (3, 4))  # started before step 2 ran
            strategy.run(lambda: model(torch.ones(2, 4)).sum())
    assert not prof.recording and MARKS.active == 0
    trace = json.loads((tmp_path / "plugins" / "profile" / "steps_2-3" / "replica0.pt.trace.json").read_text())
    assert any(e.get("name") == "aten::addmm" for e in trace["traceEvents"])


def test_collectives_are_marked_and_timed_while_a_profile_records(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    from phalanx.comm.timing import CollectiveTimes, marking

    times = CollectiveTimes()
    with torch.profiler.profile() as prof, marking():
        with times.measure("all_reduce"):
            torch.ones(3).sum()
    assert "phalanx::all_reduce" in {e.name for e in prof.events()}
    assert times.calls == 1 and times.seconds > 0


@pytest.mark.parametrize("steps", [(0, 2), (3, 2), "a,b", (1, 2, 3), None])
def test_profile_steps_must_be_a_range_of_positive_steps(tmp_path, steps):
    with pytest.raises(ProfileError, match="steps must be"):
        px.profile(tmp_path, steps=steps)


# ------------------------------------------------------------------------------ report
def test_job_report_counts_steps_samples_and_memory(capsys):
    strategy = px.OneDeviceStrategy("cpu")
    for x in strategy.experimental_distribute_dataset([torch.ones(4, 2)] * 3):
        strategy.run(lambda t: t.sum(), args=(x,))
    rep = report.job_report(strategy=strategy)
    assert rep.steps == 3 and rep.replicas[0].samples == 12 and rep.replicas[0].peak_host_bytes > 2**20
    assert rep.samples_per_second is not None and rep.replicas[0].peak_gpu_bytes is None
    printed = capsys.readouterr().out
    assert printed.startswith("phalanx job report: OneDeviceStrategy, 1 replica\n  3 steps in")


def test_job_report_through_the_summary_module(capsys):
    strategy = px.OneDeviceStrategy("cpu")
    with strategy.scope():
        strategy.run(lambda: 1.0)
        rep = summary.job_report(print_it=False)
    assert rep.steps >= 1 and capsys.readouterr().out == ""


def test_places_are_listed_once_each(tmp_path):
    places = report.Places()
    places.add("logs", "a")
    places.add("logs", "a")
    places.add("traces", "b")
    assert places.as_dict() == {"logs": ["a"], "traces": ["b"]}
