"""Checkpoints move between strategies: saved under one, restored bitwise under another.

Pairs verified: MirroredStrategy(2) -> OneDeviceStrategy and -> plain PyTorch;
MultiWorkerMirrored 2 workers -> 3 workers; OneDevice -> CentralStorage(2) -> Mirrored(2) ->
CentralStorage(2). (Sharded variables 2 -> 3 -> 1 -> none shards: test_checkpoint.py.)
Each replica of the restoring job checks what it holds against what the saving chief held.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

import phalanx as px
from phalanx.checkpoint import Checkpoint, CheckpointManager, latest_checkpoint, load_state

from conftest import run_job

sys.path.insert(0, str(Path(__file__).parent / "scripts"))
import ckpt_roundtrip as rt  # noqa: E402

rt.warm_up_adam()

SCRIPT = Path(__file__).parent / "scripts" / "ckpt_roundtrip.py"
ENV = {"PHALANX_COLLECTIVE_TIMEOUT": "20"}


def _assert_same(saved: dict, restored: dict, where: str) -> None:
    assert sorted(saved) == sorted(restored), where
    for key, value in saved.items():
        other = restored[key]
        if isinstance(value, torch.Tensor):
            assert value.dtype == other.dtype and torch.equal(value, other), f"{where}: {key}"
        else:
            assert value == other, f"{where}: {key}: {value} != {other}"
    assert any(k.startswith("optimizer/") and k.endswith("exp_avg") for k in saved), "no optimizer state saved"


def _load(path: Path) -> dict:
    return torch.load(path, weights_only=True)


def _job(tmp_path: Path, name: str, args: list[str], nproc: int | None = None) -> Path:
    out = tmp_path / name
    out.mkdir()
    launcher = [sys.executable, "-m", "phalanx.cli", "run", "-n", str(nproc)] if nproc else [sys.executable]
    res = run_job(
        launcher + [str(SCRIPT), str(out), *args], timeout=120, cwd=tmp_path, env=ENV, log_dir=tmp_path / f"logs-{name}"
    )
    assert res.returncode == 0, res.logs()[-6000:]
    return out


def _one_device_objects():
    strategy = px.OneDeviceStrategy("cpu")
    with strategy.scope():
        objects = rt.build_objects(seed=5)
        ckpt = Checkpoint(**objects)
    return strategy, objects, ckpt


STAGES = [("central", "central"), ("mirrored", "mirrored"), ("central_again", "central")]


@pytest.fixture(scope="module")
def chain_run(tmp_path_factory):
    """OneDevice (here) -> CentralStorage(2) -> Mirrored(2) -> CentralStorage(2), the three stages in
    one self-launched program, each under a fresh strategy on the same two processes, restoring from
    disk what the stage before saved (process start-up is most of what a job costs). The Mirrored(2)
    stage's checkpoint is also the source of the Mirrored -> OneDevice / plain PyTorch test."""
    root = tmp_path_factory.mktemp("chain")
    strategy, objects, ckpt = _one_device_objects()
    rt.train(strategy, objects, 2)
    source = root / "one_device"
    CheckpointManager(ckpt, str(source / "ckpts"), max_to_keep=1).save()
    res = run_job(
        [sys.executable, str(SCRIPT), str(root), "--chain", str(source / "ckpts"), "2"]
        + [f"{name}:{kind}" for name, kind in STAGES],
        timeout=180,
        cwd=root,
        env=ENV,
        log_dir=root / "logs-chain",
    )
    assert res.returncode == 0, res.logs()[-6000:]
    return root, rt.dump(objects)


def test_mirrored_to_one_device_and_to_plain_pytorch(chain_run):
    out = chain_run[0] / "mirrored"  # saved by Mirrored(2) after 2 Adam steps of its own
    saved = _load(out / "saved.pt")
    path = latest_checkpoint(str(out / "ckpts"))
    assert storage_saved_by(path) == {"strategy": "MirroredStrategy", "num_replicas_in_sync": 2}

    _, objects, ckpt = _one_device_objects()
    ckpt.restore(path).assert_consumed()
    _assert_same(saved, rt.dump(objects), "Mirrored(2) -> OneDevice")

    # No strategy at all: plain state dicts into plain PyTorch objects.
    state = load_state(path)
    plain = rt.build_objects(seed=9)
    plain["model"].load_state_dict(state["model"])
    plain["optimizer"].load_state_dict(state["optimizer"])
    plain["scheduler"].load_state_dict(state["scheduler"])
    plain["step"].load_state_dict(state["step"])
    plain["input"].load_state_dict(state["input"])
    plain["tokens"].copy_(state["tokens"])
    _assert_same(saved, rt.dump(plain), "Mirrored(2) -> plain PyTorch")


def test_multi_worker_two_workers_to_three(tmp_path):
    two = _job(tmp_path, "mwms2", ["mwms", "--train", "3", "--save"], nproc=2)
    three = _job(tmp_path, "mwms3", ["mwms", "--restore", str(two / "ckpts")], nproc=3)
    saved = _load(two / "saved.pt")
    for rank in range(3):
        _assert_same(saved, _load(three / f"restored_{rank}.pt"), f"MWMS 2 workers -> 3 workers, rank {rank}")


def test_one_device_to_central_storage_to_mirrored_and_back(chain_run):
    root, one_device = chain_run
    chain = [("one_device", one_device, root / "one_device")]
    for name, _ in STAGES:
        out = root / name
        for rank in range(2):
            _assert_same(chain[-1][1], _load(out / f"restored_{rank}.pt"), f"{chain[-1][0]} -> {name}, rank {rank}")
        chain.append((name, _load(out / "saved.pt"), out))
    assert chain[-1][1]["step"] == 8  # 2 steps in each stage, carried through every restore


def storage_saved_by(path: str) -> dict:
    from phalanx.checkpoint import storage

    return storage.read_manifest(path)["saved_by"]


ANYWHERE = Path(__file__).parent / "scripts" / "ckpt_anywhere.py"


def test_checkpoint_made_outside_scope_saves_as_a_team_under_self_launched_mirrored(tmp_path):
    """Issue 13 item 7: replica 0 saved as if alone, replica 1 raised 'no strategy is known'."""
    out = tmp_path / "out"
    out.mkdir()
    res = run_job([sys.executable, str(ANYWHERE), str(out)], timeout=120, cwd=tmp_path, env=ENV)
    assert res.returncode == 0, res.logs()[-6000:]
    results = [json.loads((out / f"result_{rank}.json").read_text()) for rank in range(2)]
    team = {"strategy": "MirroredStrategy", "num_replicas_in_sync": 2}
    for result in results:
        assert result["saved_by"] == team and result["values_only_saved_by"] == team, result
        assert result["path"] == "ckpt-1" and result["step"] == 3, result
        assert result["restored_equal"] and result["momentum_equal"], result
    assert results[0]["weight_sum"] == results[1]["weight_sum"]
    assert sorted(os.listdir(out / "ckpts")) == ["ckpt-1"]  # no leftovers of a second writer
    # Issue 16 (multi_worker_with_ctl): a replica given a path of its own writes it, as in TF.
    assert results[0]["own_path_written"] and results[1]["own_path_written"], results
    assert sorted(os.listdir(out / "workertemp_1" / "own_ckpts")) == ["ckpt-1"]
