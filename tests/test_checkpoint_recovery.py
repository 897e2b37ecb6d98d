"""Training that survives a crash in the middle of a save, a killed worker, and a preemption.

The training jobs run ``scripts/ckpt_train.py`` (MultiWorkerMirrored, 2 workers, 100 steps) under
``phalanx run -n 2 --max-restarts 1``; every one must end with exactly 100 optimizer steps and
weights bitwise equal to an uninterrupted run.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

from phalanx.checkpoint import Checkpoint, CheckpointManager, Counter, latest_checkpoint, load_state, storage

from conftest import run_job

sys.path.insert(0, str(Path(__file__).parent / "scripts"))
from ckpt_roundtrip import warm_up_adam  # noqa: E402

warm_up_adam()
TRAIN = Path(__file__).parent / "scripts" / "ckpt_train.py"
ENV = {"PHALANX_COLLECTIVE_TIMEOUT": "20"}


# --------------------------------------------------------------------------- a crash in the middle of a save
@pytest.mark.parametrize("fault", ["after_file:1", "before_commit"])
def test_crash_during_save_leaves_the_previous_checkpoint(tmp_path, script, fault):
    job = script(f"""
        import os, sys, torch
        from phalanx.checkpoint import Checkpoint, CheckpointManager, Counter
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 3)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        step = Counter()
        manager = CheckpointManager(Checkpoint(model=model, optimizer=optimizer, step=step), "ckpts", max_to_keep=1)

        def train():
            model(torch.randn(2, 4)).sum().backward()
            optimizer.step()
            step.assign_add(1)

        train()
        manager.save()
        torch.save({{"model": model.state_dict(), "momentum": optimizer.state_dict()["state"]}}, "expected.pt")
        train()
        os.environ["PHALANX_CHECKPOINT_FAULT"] = {fault!r}
        manager.save()
        print("the fault hook did not fire")
    """)
    res = run_job([sys.executable, str(job)], timeout=60, cwd=tmp_path)
    assert res.returncode == storage.FAULT_EXIT_CODE, res.output
    ckpts = tmp_path / "ckpts"
    leftovers = [n for n in os.listdir(ckpts) if n.startswith(".")]
    assert leftovers, "the fault should have struck in the middle of the save"

    latest = latest_checkpoint(str(ckpts))
    assert os.path.basename(latest) == "ckpt-1"
    expected = torch.load(tmp_path / "expected.pt", weights_only=True)
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ckpt = Checkpoint(model=model, optimizer=optimizer, step=Counter())
    manager = CheckpointManager(ckpt, str(ckpts), max_to_keep=1)
    assert manager.checkpoints == [latest]
    assert manager.restore_or_initialize() == latest  # no exception
    assert ckpt.step == 1
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in expected["model"].items())
    assert all(
        torch.equal(v["momentum_buffer"], optimizer.state_dict()["state"][i]["momentum_buffer"])
        for i, v in expected["momentum"].items()
    )
    manager.save()  # the next save cleans up after the crashed one
    assert sorted(os.listdir(ckpts)) == ["ckpt-2"]


# --------------------------------------------------------------------------- a killed worker, a preempted worker
@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    out = tmp_path_factory.mktemp("clean")
    res = run_job(
        [sys.executable, "-m", "phalanx.cli", "run", "-n", "2", str(TRAIN), str(out), "clean"],
        timeout=120,
        cwd=out,
        env=ENV,
    )
    assert res.returncode == 0, res.logs()[-6000:]
    return torch.load(out / "final.pt", weights_only=True)


def _run_with_restart(tmp_path: Path, mode: str, max_restarts: int = 1):
    res = run_job(
        [
            sys.executable,
            "-m",
            "phalanx.cli",
            "run",
            "-n",
            "2",
            "--max-restarts",
            str(max_restarts),
            str(TRAIN),
            str(tmp_path),
            mode,
        ],
        timeout=150,
        cwd=tmp_path,
        env=ENV,
    )
    assert res.returncode == 0, res.logs()[-8000:]
    attempts = [json.loads(line) for line in (tmp_path / "attempts.jsonl").read_text().splitlines()]
    executed = [tuple(map(int, line.split())) for line in (tmp_path / "executed.log").read_text().splitlines()]
    return res, attempts, executed, torch.load(tmp_path / "final.pt", weights_only=True)


def _assert_same_training(final: dict, reference: dict) -> None:
    assert final["applied"] == reference["applied"] == 100
    for k, v in reference["model"].items():
        assert torch.equal(final["model"][k], v), k
    for i, state in reference["optimizer"].items():
        for name, v in state.items():
            assert torch.equal(final["optimizer"][i][name], v), (i, name)


def test_killed_worker_restarts_from_checkpoint_with_exact_steps(tmp_path, uninterrupted):
    res, attempts, executed, final = _run_with_restart(tmp_path, "crash")
    assert "exit code 13" in res.output and "restarting the job" in res.output
    assert [a["attempt"] for a in attempts] == [0, 1]
    # Checkpoints every 5 steps; worker 1 died before step 37: the restart resumes from step 35,
    # mid-epoch 1, and replays step 36.
    assert attempts[1]["applied"] == 35 and attempts[1]["position"] == [1, 10]
    assert [s for a, s in executed if a == 0] == list(range(1, 37))
    assert [s for a, s in executed if a == 1] == list(range(36, 101))
    _assert_same_training(final, uninterrupted)


def test_bit_flipped_latest_checkpoint_falls_back_to_the_previous_valid_one(tmp_path, uninterrupted):
    """Issue 13 item 9: a damaged latest checkpoint made a --max-restarts job crash-loop."""
    res, attempts, executed, final = _run_with_restart(tmp_path, "corrupt", max_restarts=2)
    assert "exit code 13" in res.output
    assert [a["attempt"] for a in attempts] == [0, 1]  # one restart, no crash loop
    # Checkpoints every 5 steps, 2 kept: ckpt-6 (step 30) and ckpt-7 (step 35, damaged).
    assert os.path.basename(attempts[1]["restored"]) == "ckpt-6"
    assert attempts[1]["applied"] == 30 and attempts[1]["position"] == [1, 5]
    logs = res.logs()
    assert "ckpt-7" in logs and "model.pt" in logs and "SHA-256" in logs, logs[-6000:]
    assert [s for a, s in executed if a == 0] == list(range(1, 37))
    assert [s for a, s in executed if a == 1] == list(range(31, 101))
    _assert_same_training(final, uninterrupted)


def test_sigterm_to_one_worker_saves_at_an_agreed_step_and_resumes(tmp_path, uninterrupted):
    res, attempts, executed, final = _run_with_restart(tmp_path, "preempt")
    assert "exit code 42" in res.output and "asked to be restarted (preemption); restarting" in res.output
    # Worker 1 got SIGTERM before step 37; worker 0 got nothing. Both stopped after step 37.
    stops = [json.loads((tmp_path / f"preempted_{r}.json").read_text()) for r in range(2)]
    assert stops == [{"rank": r, "total_run_calls": 37, "applied": 37} for r in range(2)]
    assert attempts[1]["total_run_calls"] == 37 and attempts[1]["applied"] == 37
    assert os.path.basename(attempts[1]["restored"]) == "ckpt-4"  # after ckpt-1..3 at steps 10, 20, 30
    assert [s for a, s in executed if a == 0] == list(range(1, 38))  # nobody trained past 37
    assert [s for a, s in executed if a == 1] == list(range(38, 101))
    last = load_state(latest_checkpoint(str(tmp_path / "ckpts")))  # the regular save after step 100
    assert last["_preemption_run_calls"] == {"value": 100} and last["applied"] == {"value": 100}
    _assert_same_training(final, uninterrupted)
