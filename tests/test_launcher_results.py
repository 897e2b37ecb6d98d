"""Every route's launcher says how its run ended with one ``RunResult`` (torch elastic's): the state,
every replica task's end and the root cause, read from the one Supervisor's records.

``ScriptLauncher.run()`` and ``ReplicaLauncher.result()`` are exercised by the job tests
(``tests/test_supervisor.py``); here the notebook's launcher and the parameter-server cluster's
(``phalanx run --ps``).
"""

from __future__ import annotations

import os

import pytest

from phalanx.launch.lifecycle import JobState


def _become(codes: dict[int, int]):
    """A forked replica's life in these tests: exit with ``codes[rank]`` at once, or (absent) wait
    on its control channel until the launcher asks it to exit."""

    def become(rank, channel):  # pragma: no cover - runs in the forked child
        if rank in codes:
            os._exit(codes[rank])
        try:
            channel.recv()
        finally:
            os._exit(0)

    return become


def test_a_notebook_launchers_result_names_the_replica_that_failed(tmp_path):
    from phalanx.launch.notebook import NotebookLauncher

    launcher = NotebookLauncher(3, "fork", str(tmp_path))
    assert launcher.fork(_become({1: 3})) is None  # the parent: replicas 1 and 2 were forked
    try:
        assert launcher.state is JobState.RUNNING and not launcher.result().is_failed
        assert launcher.reap(launcher.replicas[1], wait=30) == 3
        launcher.stop(graceful=True)  # replica 2 is asked to exit, and does
        launcher.close(1)  # the session ends failed (a replica failed)
        result = launcher.result()
        assert result.state is JobState.FAILED and result.is_failed and result.status == 3, result
        assert result.root_cause is not None and result.root_cause.task.name == "replica 1", result
        assert sorted((e.task.name, e.code) for e in result.exits) == [("replica 1", 3), ("replica 2", 0)], result
    finally:
        launcher.supervisor.kill([r.run for r in launcher.replicas.values()])


def test_a_notebook_launchers_result_after_a_clean_end_has_no_root_cause(tmp_path):
    from phalanx.launch.notebook import NotebookLauncher

    launcher = NotebookLauncher(2, "fork", str(tmp_path))
    assert launcher.fork(_become({})) is None
    try:
        launcher.stop(graceful=True)
        launcher.close(0)
        result = launcher.result()
        assert (result.state, result.status, result.root_cause) == (JobState.SUCCEEDED, 0, None), result
        assert [(e.task.name, e.code) for e in result.exits] == [("replica 1", 0)], result
    finally:
        launcher.supervisor.kill([r.run for r in launcher.replicas.values()])


_TASK = """
import json, os, sys
task = json.loads(os.environ["TF_CONFIG"])["task"]
sys.exit(int(sys.argv[1]) if task["type"] == "chief" else 0)
"""


@pytest.mark.parametrize("chief_status", [0, 5])
def test_the_parameter_server_cluster_launcher_is_a_launcher_with_a_run_result(tmp_path, chief_status):
    from phalanx.ps.cluster_launcher import ClusterJob, ClusterLauncher

    script = tmp_path / "task.py"
    script.write_text(_TASK)
    job = ClusterJob(
        command=(str(script), str(chief_status)), num_ps=1, num_workers=2, log_dir=str(tmp_path), shutdown_grace=5.0
    )
    launcher = ClusterLauncher(job)
    # The Launcher interface (phalanx.launch.launcher.Launcher: a Protocol), member by member.
    assert all(callable(getattr(launcher, m, None)) for m in ("check_peers", "strategy_opened", "strategy_closed"))
    assert launcher.state is JobState.STARTING
    result = launcher.run()
    assert sorted((e.task.name, e.code) for e in result.exits) == [
        ("chief:0", chief_status),
        ("ps:0", 0),
        ("worker:0", 0),
        ("worker:1", 0),
    ], result
    if chief_status == 0:
        assert (result.state, result.status, result.root_cause) == (JobState.SUCCEEDED, 0, None), result
    else:
        assert result.state is JobState.FAILED and result.status == chief_status, result
        assert result.root_cause is not None and result.root_cause.task.name == "chief:0", result
