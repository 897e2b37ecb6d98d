"""Every byte of a checkpoint is verified before it is chosen (issue 29, item 1).

``MANIFEST.json`` holds the non-tensor state (counters, optimizer hyperparameters, user values)
and the SHA-256 of every tensor file; ``MANIFEST.sha256``, written after it, holds its digest.
A one-bit flip anywhere must make ``restore_or_initialize()`` fall back to the previous
checkpoint with one warning naming the damaged file, and ``restore(path)`` refuse with a typed
error naming it; never restore wrong state. The flip campaign is
``python -m benchmarks.checkpoint_verify --bitflips`` (its counts go in the issue's closing note);
the multi-process case runs tests/scripts/ckpt_integrity.py on 2 Mirrored replicas.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path

import pytest
import torch

from phalanx.checkpoint import (
    Checkpoint,
    CheckpointManager,
    CorruptCheckpointError,
    Counter,
    latest_checkpoint,
    storage,
)

from conftest import run_job

sys.path.insert(0, str(Path(__file__).parent / "scripts"))
from ckpt_roundtrip import warm_up_adam  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
# The counting lives in benchmarks/ (rerun: python -m benchmarks.checkpoint_verify --bitflips), which
# is not an installed package: import it from the clone, as tests/test_cli.py does.
sys.path.insert(0, str(ROOT))
try:
    from benchmarks.checkpoint_verify import TARGETED, bitflip_counts
finally:
    sys.path.remove(str(ROOT))

warm_up_adam()  # torch's first optimizer step sets TORCHINDUCTOR_CACHE_DIR: before the env check
SCRIPT = Path(__file__).parent / "scripts" / "ckpt_integrity.py"
SIDECAR = "MANIFEST.sha256"


def _skips(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "phalanx.checkpoint" and r.levelno == logging.WARNING]


def _two_saves(directory: Path) -> tuple[list[str], Checkpoint]:
    w, step = torch.zeros(8), Counter()
    ckpt = Checkpoint(w=w, step=step, epochs=0)
    manager = CheckpointManager(ckpt, str(directory), max_to_keep=3)
    paths = []
    for n in (1, 3):
        step.assign(n)
        w += 1
        ckpt.epochs = 7
        paths.append(manager.save())
    return paths, ckpt


def _fresh() -> Checkpoint:
    return Checkpoint(w=torch.full((8,), -1.0), step=Counter(), epochs=0)


def _flip_byte(path: str, file: str, offset: int, bit: int) -> None:
    target = Path(path, file)
    data = bytearray(target.read_bytes())
    data[offset] ^= 1 << bit
    target.write_bytes(bytes(data))


def test_two_hundred_bit_flips_never_restore_wrong_state(tmp_path):
    counts = bitflip_counts(str(tmp_path))
    print(json.dumps({k: v for k, v in counts.items() if k != "failures"}))  # for the closing note
    assert counts["flips"] >= 200, counts
    assert counts["restored_wrong"] == 0, counts["failures"]
    assert set(counts["flips_per_file"]) == {"MANIFEST.json", SIDECAR, "model.pt", "optimizer.pt"}, counts
    # Every flip, anywhere: the manager fell back with one warning, restore(path) refused.
    assert counts["fell_back_with_warning"] == counts["flips"], counts["failures"]
    assert counts["refused"] == counts["flips"], counts["failures"]


def test_the_issues_targeted_manifest_flips_fall_back_and_refuse(tmp_path):
    """Step 3 -> 7, lr 0.01 -> 0.05, beta1 0.9 -> 0.1, epochs 7 -> 3, a renamed optimizer key."""
    counts = bitflip_counts(str(tmp_path), per_file=0, manifest_flips=0)  # the targeted flips only
    assert counts["flips"] == len(TARGETED) == 5
    assert counts["fell_back_with_warning"] == counts["refused"] == counts["flips"], counts["failures"]


def test_an_unparsable_manifest_is_skipped_with_a_warning(tmp_path, caplog):
    paths, _ = _two_saves(tmp_path)
    Path(paths[1], storage.MANIFEST).write_bytes(b"{not json")
    caplog.set_level(logging.WARNING, logger="phalanx.checkpoint")
    assert latest_checkpoint(str(tmp_path)) == paths[0]
    warnings = _skips(caplog)
    assert len(warnings) == 1 and paths[1] in warnings[0] and storage.MANIFEST in warnings[0], warnings
    with pytest.raises(CorruptCheckpointError, match="MANIFEST.json"):
        _fresh().restore(paths[1])


def test_a_flipped_step_counter_falls_back_through_the_manager(tmp_path, caplog):
    paths, _ = _two_saves(tmp_path)
    text = Path(paths[1], storage.MANIFEST).read_text()
    _flip_byte(paths[1], storage.MANIFEST, text.index('"value": 3') + len('"value": '), 2)  # 3 -> 7
    caplog.set_level(logging.WARNING, logger="phalanx.checkpoint")
    ckpt = _fresh()
    manager = CheckpointManager(ckpt, str(tmp_path), max_to_keep=3)
    assert manager.checkpoints == [paths[0]]  # a checkpoint whose manifest is damaged is not listed
    assert manager.restore_or_initialize() == paths[0]
    assert int(ckpt.step) == 1 and torch.equal(ckpt.w, torch.ones(8))
    warnings = _skips(caplog)
    assert len(warnings) == 1 and paths[1] in warnings[0] and storage.MANIFEST in warnings[0], warnings
    with pytest.raises(CorruptCheckpointError, match="MANIFEST.json.*SHA-256"):
        _fresh().restore(paths[1])
    # Training goes on: the next save takes the damaged one's number and replaces it.
    assert manager.save() == paths[1] and latest_checkpoint(str(tmp_path)) == paths[1]


def test_a_missing_digest_file_is_damage_not_an_old_checkpoint(tmp_path, caplog):
    paths, _ = _two_saves(tmp_path)
    os.remove(os.path.join(paths[1], SIDECAR))
    caplog.set_level(logging.WARNING, logger="phalanx.checkpoint")
    assert CheckpointManager(_fresh(), str(tmp_path), max_to_keep=3).restore_or_initialize() == paths[0]
    warnings = _skips(caplog)
    assert len(warnings) == 1 and paths[1] in warnings[0] and SIDECAR in warnings[0], warnings
    with pytest.raises(CorruptCheckpointError, match=SIDECAR):
        _fresh().restore(paths[1])


def test_a_checkpoint_of_the_previous_version_still_restores(tmp_path, caplog):
    """No digest file and no mention of one (as the previous phalanx wrote): restored, unverified, said once."""
    paths, _ = _two_saves(tmp_path)
    for path in paths:
        os.remove(os.path.join(path, SIDECAR))
        manifest = json.loads(Path(path, storage.MANIFEST).read_text())
        del manifest["manifest_digest"]
        Path(path, storage.MANIFEST).write_text(json.dumps(manifest, indent=1))
    storage.forget_verified()
    caplog.set_level(logging.WARNING, logger="phalanx.checkpoint")
    ckpt = _fresh()
    assert CheckpointManager(ckpt, str(tmp_path), max_to_keep=3).restore_or_initialize() == paths[1]
    assert int(ckpt.step) == 3 and ckpt.epochs == 7 and torch.equal(ckpt.w, torch.full((8,), 2.0))
    _fresh().restore(paths[0])
    assert latest_checkpoint(str(tmp_path)) == paths[1]
    warnings = _skips(caplog)
    assert len(warnings) == 1 and "not verified" in warnings[0] and str(tmp_path) in warnings[0], warnings


def test_parameter_server_checkpoints_fall_back_too(tmp_path, caplog):
    """The chief saves the servers' values and Adam state; a flipped lr in the newest makes the
    manager restore the previous one onto the servers, and restore(path) refuse."""
    pytest.importorskip("cloudpickle")
    from phalanx.ps.testing import InProcessCluster

    with InProcessCluster(num_ps=2, num_workers=1) as cluster:
        with cluster.strategy.scope():
            torch.manual_seed(0)
            model = torch.nn.Linear(4, 2)
            optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
        coordinator = cluster.coordinator()

        def step():
            model(torch.ones(3, 4)).sum().backward()
            optimizer.step()
            optimizer.zero_grad()

        ckpt = Checkpoint(model=model, optimizer=optimizer)
        manager = CheckpointManager(ckpt, str(tmp_path), max_to_keep=3)
        saved = []
        for _ in range(2):
            coordinator.schedule(step)
            coordinator.join()
            saved.append({k: v.clone() for k, v in model.state_dict().items()})
            manager.save()
        older, newest = manager.checkpoints
        text = Path(newest, storage.MANIFEST).read_text()
        _flip_byte(newest, storage.MANIFEST, text.index('"lr": 0.01') + len('"lr": 0.0'), 2)  # 0.01 -> 0.05
        caplog.set_level(logging.WARNING, logger="phalanx.checkpoint")
        storage.forget_verified()
        assert CheckpointManager(ckpt, str(tmp_path), max_to_keep=3).restore_or_initialize() == older
        warnings = _skips(caplog)
        assert len(warnings) == 1 and newest in warnings[0] and storage.MANIFEST in warnings[0], warnings
        on_worker = coordinator.schedule(lambda: {k: v.detach().clone() for k, v in model.state_dict().items()})
        assert all(torch.equal(v, saved[0][k]) for k, v in on_worker.fetch().items())
        assert optimizer.param_groups[0]["lr"] == 0.01
        with pytest.raises(CorruptCheckpointError, match="MANIFEST.json"):
            ckpt.restore(newest)


@pytest.fixture(scope="module")
def replicas(tmp_path_factory):
    out = tmp_path_factory.mktemp("integrity")
    res = run_job(
        [sys.executable, str(SCRIPT), str(out)],
        timeout=180,
        cwd=out,
        env={"KERAS_BACKEND": "torch", "OMP_NUM_THREADS": "1"},
    )
    assert res.returncode == 0, res.logs()[-6000:]
    return [json.loads((out / f"integrity_{r}.json").read_text()) for r in range(2)]


def test_both_mirrored_replicas_fall_back_to_the_same_previous_checkpoint(replicas):
    assert replicas[0]["chosen"] == replicas[1]["chosen"] == replicas[0]["older"], replicas
    for got in replicas:
        assert got["step"] == 1 and got["w"] == [1.0] * 4, got
        warnings = got["warnings"]
        assert len(warnings) == 1 and got["newest"] in warnings[0] and "MANIFEST.json" in warnings[0], warnings
        assert got["restore_error"].startswith("CorruptCheckpointError"), got


def test_damaged_old_checkpoints_are_deleted_with_the_old_ones(tmp_path, caplog):
    """max_to_keep counts intact checkpoints; a damaged one older than all kept ones goes with them."""
    paths, _ = _two_saves(tmp_path)
    Path(paths[0], storage.MANIFEST).write_bytes(b"{not json")
    manager = CheckpointManager(_fresh(), str(tmp_path), max_to_keep=2)
    assert manager.checkpoints == [paths[1]]
    third = manager.save(checkpoint_number=5)
    assert manager.checkpoints == [paths[1], third] and os.path.isdir(paths[0])
    fourth = manager.save(checkpoint_number=6)
    assert manager.checkpoints == [third, fourth] and not os.path.exists(paths[0])
    assert sorted(os.listdir(tmp_path)) == sorted(os.path.basename(p) for p in (third, fourth))
