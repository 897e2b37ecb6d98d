"""The flight recorder and the diagnosis, without processes (the real jobs: test_hang_diagnosis.py).

* The ring keeps the last N collectives in order; what is in flight, ended or failed.
* A collective's source line is looked up once per entry point or step (a step's gradient buckets
  share one walk), never kept outside one, and is the first frame outside phalanx, torch and Keras.
* The diagnosis's verdicts from snapshots: an extra call, a missing one, a skipped step, another
  shape, buckets that differ, a late arrival, a dead or stopped replica; live views name nobody as
  the cause; a replica running its own code is busy, not stuck.
* ``phalanx diagnose`` prints a kept diagnosis, and says when there is none; the benchmark's summary.
"""

from __future__ import annotations

import json
import pickle
import sys

import pytest
import torch

from phalanx.comm import diagnosis, flight_recorder
from phalanx.comm.flight_recorder import FlightRecorder, user_site
from phalanx.errors import CollectiveTimeoutError, PeerUnavailableError

from conftest import benchmark_module


# ----------------------------------------------------------------------------- the ring
def test_the_ring_keeps_the_last_collectives_in_order():
    rec = FlightRecorder(capacity=5)  # rounded up to a power of two, at least 8
    assert rec.capacity == 8
    for i in range(1, 21):
        slot = rec.begin("all_reduce", torch.ones(i), step=i, start=float(i))
        rec.ends[slot] = i + 0.5
    records = rec.to_json()
    assert [r["seq"] for r in records] == list(range(13, 21))
    assert [r["numel"] for r in records] == list(range(13, 21)) and records[-1]["dtype"] == "float32"
    assert rec.current() is None
    slot = rec.begin("broadcast", torch.ones(2, dtype=torch.int64), step=21, start=30.0)
    assert rec.current()[0] == 21 and rec.to_json()[-1]["end"] is None  # in flight
    rec.failed(slot, CollectiveTimeoutError([], step=21, operation="x", cause="y"))
    assert rec.current() is None and rec.to_json()[-1]["error"] == "CollectiveTimeoutError"


def test_labels_name_the_collectives_inside_and_restore_the_outer_one():
    rec = FlightRecorder()
    with rec.label("reduce"):
        rec.begin("all_reduce", torch.ones(1), 1, 0.0)
        with rec.label("guard"):
            rec.begin("all_gather", torch.ones(1), 1, 0.0)
        rec.begin("all_reduce", torch.ones(1), 1, 0.0)
    rec.begin("barrier", torch.ones(1), 1, 0.0)
    bucket = rec.labelled("gradient bucket", lambda t: rec.begin("all_reduce", t, 1, 0.0))
    bucket(torch.ones(3))
    assert [r["kind"] for r in rec.to_json()] == ["reduce", "guard", "reduce", "barrier", "gradient bucket"]


def test_the_source_line_is_looked_up_once_per_entry_point_and_step(monkeypatch):
    walks = []
    real = flight_recorder.user_site
    monkeypatch.setattr(flight_recorder, "user_site", lambda *a: walks.append(1) or real(*a))
    rec = FlightRecorder()
    saved = rec.enter_step(sys._getframe())
    for _ in range(5):  # a step's gradient buckets: one walk
        rec.begin("all_reduce", torch.ones(1), 1, 0.0)
    assert len(walks) == 1
    with rec.label("all_reduce"):  # an entry point inside the step: its own line, once
        rec.begin("all_reduce", torch.ones(1), 1, 0.0)
        rec.begin("all_reduce", torch.ones(1), 1, 0.0)
    assert len(walks) == 2
    rec.begin("all_reduce", torch.ones(1), 1, 0.0)  # the step's line again, not looked up again
    assert len(walks) == 2
    rec.leave_step(saved)
    rec.begin("barrier", torch.ones(1), None, 0.0)  # outside any step or entry point: every time,
    rec.begin("barrier", torch.ones(1), None, 0.0)  # and never kept for the next one
    assert len(walks) == 4


def _library_chain(depth, leaf):
    """``leaf`` called under ``depth`` frames of a module named like torch's."""
    namespace = {"__name__": "torch.autograd._test_frames", "leaf": leaf}
    source = "def f0():\n    return leaf()\n" + "".join(
        f"def f{k}():\n    return f{k - 1}()\n" for k in range(1, depth)
    )
    exec(source, namespace)
    return namespace[f"f{depth - 1}"]


def test_the_source_line_is_the_first_frame_outside_phalanx_torch_and_keras():
    rec = FlightRecorder()
    with rec.label("reduce"):
        line = sys._getframe().f_lineno + 1
        _library_chain(6, lambda: rec.begin("all_reduce", torch.ones(1), 1, 0.0))()
    site = rec.to_json()[0]["site"]
    assert site[0] == __file__ and site[1] == line, site
    assert site[3].startswith("_library_chain(6, lambda"), site  # the source text comes along


def test_a_thread_with_no_user_frame_falls_back_to_the_frame_that_called_run():
    """As autograd's device threads on GPUs: nothing but library frames between the thread's start
    and the collective."""
    import threading

    namespace = {"__name__": "torch.autograd._test_device_thread", "user_site": user_site, "sys": sys, "found": []}
    exec(
        "def hook(fallback):\n    found.append(user_site(sys._getframe(), fallback))\n"
        "def engine(fallback):\n    hook(fallback)\n",
        namespace,
    )
    caller = sys._getframe()
    for fallback in (None, caller):
        worker = threading.Thread(target=namespace["engine"], args=(fallback,))
        worker.start()
        worker.join()
    assert namespace["found"][0] == ()
    assert namespace["found"][1][2] == "test_a_thread_with_no_user_frame_falls_back_to_the_frame_that_called_run"


# ----------------------------------------------------------------------------- verdicts
def _call(seq, step, kind, line, numel=5, op="all_reduce", end=1.0, error=None, start=0.0):
    return {
        "seq": seq,
        "op": op,
        "kind": kind,
        "numel": numel,
        "dtype": "float32",
        "step": step,
        "site": ["train.py", line, "f", f"line {line}"],
        "start": start,
        "end": end,
        "error": error,
    }


def _snap(rank, calls, *, stack=None, cpu=None, runnable=None, step=None):
    return {
        "rank": rank,
        "name": f"replica:{rank} (rank {rank})",
        "pid": 100 + rank,
        "time": 100.0,
        "step": step,
        "timeout": 5.0,
        "collectives": calls,
        "stack": stack or [],
        "cpu": cpu,
        "runnable": runnable,
    }


def _steps(n):
    """n ordinary steps: a gradient bucket (line 7) and a reduce (line 14) each."""
    calls = []
    for step in range(1, n + 1):
        calls += [_call(len(calls) + 1, step, "gradient bucket", 7), _call(len(calls) + 2, step, "reduce", 14)]
    return calls


def test_an_extra_collective_is_named_with_its_line():
    common = _steps(4)
    zero = common + [_call(9, 5, "gradient bucket", 7, end=None)]
    one = common + [_call(9, 4, "reduce", 12, end=None)]  # a reduce at line 12 only replica 1 makes
    d = diagnosis.analyse({0: _snap(0, zero), 1: _snap(1, one)}, 2)
    assert d["parting"]["verdict"] == "an extra collective" and d["culprits"][0] == 1
    assert "train.py:12" in d["parting"]["text"] and "train.py:12" in d["hint"]


def test_a_missing_collective_is_named_on_the_replica_that_moved_on():
    common = _steps(4)
    zero = common + [_call(9, 5, "gradient bucket", 7), _call(10, 5, "reduce", 14, end=None)]
    one = common + [_call(9, 5, "gradient bucket", 7), _call(10, 6, "gradient bucket", 7, end=None)]
    d = diagnosis.analyse({0: _snap(0, zero), 1: _snap(1, one)}, 2)
    assert d["parting"]["verdict"] == "a missing collective" and d["culprits"][0] == 1, d["parting"]
    assert "train.py:14" in d["parting"]["text"] and "train.py:7" in d["parting"]["text"]


@pytest.mark.parametrize("same_place", [True, False])
def test_a_step_with_no_collective_on_one_replica_is_a_skipped_step(same_place):
    common = _steps(2)
    if same_place:  # a step of one collective: the next step's bucket meets this step's
        zero, one = common + [_call(5, 3, "gradient bucket", 7)], common + [_call(5, 4, "gradient bucket", 7)]
    else:  # replica 1 made nothing in step 3 and went on to step 4's bucket
        zero = common + [_call(5, 3, "reduce", 14, end=None)]
        one = common + [_call(5, 4, "gradient bucket", 7, end=None)]
        zero[-1]["kind"], zero[-1]["site"][1] = "reduce", 14
    d = diagnosis.analyse({0: _snap(0, zero), 1: _snap(1, one)}, 2)
    assert d["parting"]["verdict"] == "a skipped step" and d["culprits"][0] == 1, d["parting"]
    assert "step 3" in d["parting"]["text"]


@pytest.mark.parametrize(
    ("kind", "verdict"),
    [("reduce", "a collective with another shape"), ("gradient bucket", "gradient buckets that differ")],
)
def test_the_same_call_with_another_size(kind, verdict):
    zero = _steps(1) + [_call(3, 2, kind, 9, numel=4)]
    one = _steps(1) + [_call(3, 2, kind, 9, numel=3)]
    d = diagnosis.analyse({0: _snap(0, zero), 1: _snap(1, one)}, 2)
    assert d["parting"]["verdict"] == verdict and "4 float32 on replica:0" in d["parting"]["text"]


def test_a_replica_in_its_own_code_is_named_busy_or_blocked_never_the_one_that_waited():
    stack = [{"file": "train.py", "line": 30, "function": "evaluate", "text": "score(model)", "user": True}]
    waiting = _snap(0, _steps(2) + [_call(5, 3, "gradient bucket", 7, end=None, error="CollectiveTimeoutError")])
    for cpu, runnable, word in ((0.4, 0.95, "busy, not stuck"), (0.01, 0.02, "blocked")):
        other = _snap(1, _steps(2), stack=stack, cpu=cpu, runnable=runnable, step=2)
        d = diagnosis.analyse({0: waiting, 1: other}, 2)
        assert d["culprits"] == [1] and d["parting"] is None
        assert word in d["summary"] and "train.py:30" in d["summary"], d["summary"]
        if word == "busy, not stuck":  # the setting that bounds the wait, and the way out
            assert "PHALANX_COLLECTIVE_TIMEOUT (5 s)" in d["hint"] and "phalanx.wait_for_chief()" in d["hint"]


def test_dead_stopped_and_late_replicas():
    waiting = _snap(0, _steps(2) + [_call(5, 3, "gradient bucket", 7, end=None, error="PeerUnavailableError")])
    d = diagnosis.analyse({0: waiting}, 2, absent={1: "dead: its process (7) has exited"})
    assert d["culprits"] == [1] and "dead" in d["summary"]
    d = diagnosis.analyse({0: waiting}, 2, absent={1: "stopped (SIGSTOP or a debugger), pid 7"})
    assert d["culprits"] == [1] and "stopped" in d["summary"]
    early = _snap(0, [_call(1, None, "broadcast", 3, end=None, start=10.0, error="CollectiveTimeoutError")])
    late = _snap(1, [_call(1, None, "broadcast", 3, end=None, start=14.8)])
    d = diagnosis.analyse({0: early, 1: late}, 2)
    assert "reached collective #1 4.8 s after replica:0" in d["summary"], d["summary"]


def test_a_live_view_names_no_cause():
    waiting = _snap(0, _steps(2) + [_call(5, 3, "gradient bucket", 7, end=None, start=99.7)])
    stack = [{"file": "train.py", "line": 20, "function": "<module>", "text": "time.sleep(0.5)", "user": True}]
    slow = _snap(1, _steps(2), stack=stack, cpu=0.0, runnable=0.0, step=2)
    d = diagnosis.analyse({0: waiting, 1: slow}, 2, live=True)
    text = diagnosis.render(d)
    assert d["culprits"] == [] and text.startswith("live view of the job (nothing was stopped)"), text
    assert "waits (0.3 s so far)" in text and "train.py:20" in text and "not reached collective #5 yet" in text
    for word in ("stuck", "never arrived", "the cause", "failed"):
        assert word not in text, text


def test_the_first_diagnosis_of_an_attempt_is_kept_unless_a_later_one_finds_the_parting(tmp_path):
    waiting = _snap(0, _steps(2) + [_call(5, 3, "gradient bucket", 7, end=None)])
    first = diagnosis.analyse({0: waiting}, 2, absent={1: "dead: its process (7) has exited"})
    diagnosis.write(first, str(tmp_path))
    parted = diagnosis.analyse(
        {0: _snap(0, _steps(2) + [_call(5, 3, "reduce", 12)]), 1: _snap(1, _steps(2) + [_call(5, 3, "reduce", 14)])}, 2
    )
    diagnosis.write(first | {"summary": "second"}, str(tmp_path), keep_within=60)
    assert diagnosis.read(str(tmp_path))["summary"] == first["summary"]  # kept
    diagnosis.write(parted, str(tmp_path), keep_within=60)
    assert diagnosis.read(str(tmp_path))["parting"] is not None  # the parting replaces it
    assert diagnosis.read(str(tmp_path), since=2**40) is None  # older than asked for


def test_an_error_rewritten_from_a_diagnosis_still_pickles():
    e = CollectiveTimeoutError(["replica:1 (rank 1)"], step=3, operation="all-reduce", cause="asleep", hint="wake it")
    again = pickle.loads(pickle.dumps(e))
    assert type(again) is CollectiveTimeoutError and str(again) == str(e) and again.peers == e.peers
    assert isinstance(
        pickle.loads(pickle.dumps(PeerUnavailableError([], step=None, operation="x", cause="y"))), PeerUnavailableError
    )


# ----------------------------------------------------------------------------- phalanx diagnose
def test_phalanx_diagnose_prints_a_kept_diagnosis_and_says_when_there_is_none(tmp_path, capsys):
    from phalanx.cli import main

    run = tmp_path / "20261128-101500-1a2b3c"
    run.mkdir()
    assert main(["diagnose", str(run)]) == 1
    assert "holds no diagnosis" in capsys.readouterr().err
    found = diagnosis.analyse({0: _snap(0, _steps(1))}, 2, absent={1: "dead: its process (7) has exited"})
    diagnosis.write(found, str(run))
    assert main(["diagnose", str(run)]) == 0
    assert capsys.readouterr().out.strip() == diagnosis.render(found)
    assert main(["diagnose", str(run), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["culprits"] == [1]
    assert main(["diagnose", "--live", "--wait", "0.3", str(run)]) == 1  # nobody runs there
    assert "no replica" in capsys.readouterr().err
    assert main(["diagnose", str(tmp_path / "missing")]) == 2


def test_the_benchmark_reports_the_cost_per_collective(tmp_path):
    bench = benchmark_module("flight_recorder")
    out = tmp_path / "fr.json"
    result = bench.main(["--no-callgrind", "--rounds", "1", "--calls", "500", "--out", str(out)])
    assert json.loads(out.read_text())["summary"] == result["summary"]
    assert set(result["summary"]) >= {"record_ns_per_collective", "gradient_bucket_total_ns", "under_1_us"}
    assert result["machine"]["cpu_model"] is not None and result["per_step_source_line"]["library_frames"] == 10
