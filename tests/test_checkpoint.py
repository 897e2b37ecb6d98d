"""phalanx.checkpoint in one process: format, manager, input position, sharding, safety, preemption logic.

Multi-process behaviour (strategy pairs, crash and preemption recovery) is in
test_checkpoint_strategies.py and test_checkpoint_recovery.py.
"""

from __future__ import annotations

import ast
import json
import math
import os
import pickle
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import phalanx as px
from phalanx.checkpoint import (
    Checkpoint,
    CheckpointError,
    CheckpointManager,
    CheckpointMismatchError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    Counter,
    InputPosition,
    PreemptionCheckpointHandler,
    TerminationConfig,
    UnsafeCheckpointError,
    UnsupportedStateError,
    codec,
    latest_checkpoint,
    load_state,
    register_sharded_type,
    storage,
)
from phalanx.checkpoint.sharded_variables import split_full

SRC = Path(__file__).resolve().parents[1] / "src"

sys.path.insert(0, str(Path(__file__).parent / "scripts"))
from ckpt_roundtrip import warm_up_adam  # noqa: E402

warm_up_adam()


def _trained(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.BatchNorm1d(6), torch.nn.ReLU(), torch.nn.Linear(6, 2))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01, betas=(0.8, 0.95))
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    for _ in range(3):
        model(torch.randn(5, 4)).pow(2).sum().backward()
        optimizer.step()
        scheduler.step()
    return model, optimizer, scheduler


def _assert_tree_equal(a, b, path="") -> None:
    assert type(a) is type(b), f"{path}: {type(a)} != {type(b)}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b), path
    elif isinstance(a, dict):
        assert list(a) == list(b), path
        for k in a:
            _assert_tree_equal(a[k], b[k], f"{path}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_tree_equal(x, y, f"{path}/{i}")
    elif isinstance(a, float) and math.isnan(a):
        assert math.isnan(b), path
    else:
        assert a == b, path


# --------------------------------------------------------------------------- round trips
def test_restore_is_bitwise_for_every_kind_of_object(tmp_path):
    model, optimizer, scheduler = _trained(0)
    step, position = Counter(41), InputPosition(epoch=2, batch=7)
    step_tensor = torch.tensor(41, dtype=torch.int64)
    extra = {"history": [0.5, float("nan"), float("inf")], "name": "run-1", "none": None, "w": torch.arange(3.0)}
    ckpt = Checkpoint(
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        step=step,
        input=position,
        step_tensor=step_tensor,
        extra=extra,
        lr=0.125,
    )
    path = ckpt.save(str(tmp_path / "ckpt"))
    assert path == str(tmp_path / "ckpt-1") and int(ckpt.save_counter) == 1

    model2, optimizer2, scheduler2 = _trained(1)  # different values everywhere
    live_tensor = torch.zeros((), dtype=torch.int64)
    extra2 = {"history": [], "name": "", "none": 3, "w": torch.zeros(3)}
    w_before = extra2["w"]
    ckpt2 = Checkpoint(
        model=model2,
        optimizer=optimizer2,
        scheduler=scheduler2,
        step=Counter(),
        input=InputPosition(),
        step_tensor=live_tensor,
        extra=extra2,
        lr=1.0,
    )
    status = ckpt2.restore(path).assert_consumed()
    assert sorted(status.restored) == sorted(
        ["save_counter", "model", "optimizer", "scheduler", "step", "input", "step_tensor", "extra", "lr"]
    )
    _assert_tree_equal(model.state_dict(), model2.state_dict())
    _assert_tree_equal(optimizer.state_dict(), optimizer2.state_dict())
    _assert_tree_equal(scheduler.state_dict(), scheduler2.state_dict())
    assert ckpt2.step == 41 and (ckpt2.input.epoch, ckpt2.input.batch) == (2, 7)
    assert ckpt2.step_tensor is live_tensor and int(live_tensor) == 41  # restored in place
    assert ckpt2.extra is extra2 and extra2["w"] is w_before  # containers and tensors in place
    _assert_tree_equal(extra, extra2)
    assert ckpt2.lr == 0.125 and int(ckpt2.save_counter) == 1


def test_plain_pytorch_reads_a_checkpoint_without_phalanx_objects(tmp_path):
    model, optimizer, _ = _trained(0)
    path = Checkpoint(model=model, optimizer=optimizer, step=Counter(9)).write(str(tmp_path / "final"))
    state = load_state(path)
    fresh, fresh_opt, _ = _trained(3)
    fresh.load_state_dict(state["model"])
    fresh_opt.load_state_dict(state["optimizer"])
    _assert_tree_equal(model.state_dict(), fresh.state_dict())
    _assert_tree_equal(optimizer.state_dict(), fresh_opt.state_dict())
    assert state["step"] == {"value": 9}
    # A module's file is its state_dict for plain torch.load.
    plain = torch.load(os.path.join(path, "model.pt"), weights_only=True)
    _assert_tree_equal(dict(model.state_dict()), plain)


def test_codec_keeps_types_keys_and_special_floats():
    tree = {
        "t": (1, 2.5, "x", None, True),
        3: [float("-inf"), {"__odd": 1}],
        (1, "a"): torch.float16,
        "arr": np.arange(4, dtype=np.int16),
        "np": np.float32(1.5),
        "nested": {"a": {"b": torch.ones(2, 2)}},
    }
    doc, tensors = codec.encode(tree)
    json.dumps(doc)  # JSON-serialisable
    back = codec.decode(json.loads(json.dumps(doc)), tensors)
    assert back["t"] == (1, 2.5, "x", None, True) and back[3][0] == float("-inf") and back[3][1] == {"__odd": 1}
    assert back[(1, "a")] is torch.float16
    assert (
        isinstance(back["arr"], np.ndarray) and back["arr"].dtype == np.int16 and back["arr"].tolist() == [0, 1, 2, 3]
    )
    assert back["np"] == 1.5 and torch.equal(back["nested"]["a"]["b"], torch.ones(2, 2))
    assert sorted(tensors) == ["arr", "nested/a/b"]


def test_unsupported_values_are_named(tmp_path):
    with pytest.raises(UnsupportedStateError, match="extra/fn"):
        Checkpoint(extra={"fn": print}).write(str(tmp_path / "c"))
    assert not os.listdir(tmp_path)


def test_views_are_stored_alone(tmp_path):
    big = torch.arange(1000.0)
    path = Checkpoint(part=big[10:13]).write(str(tmp_path / "c"))
    assert os.path.getsize(os.path.join(path, "part.pt")) < 2000
    assert torch.equal(load_state(path)["part"], torch.tensor([10.0, 11.0, 12.0]))


def test_mismatches_raise_typed_errors(tmp_path):
    path = Checkpoint(model=torch.nn.Linear(3, 2), w=torch.zeros(4)).write(str(tmp_path / "c"))
    with pytest.raises(CheckpointMismatchError, match="model"):
        Checkpoint(model=torch.nn.Linear(5, 2)).restore(path)
    with pytest.raises(CheckpointMismatchError, match=r"shape \(3,\) here, \(4,\)"):
        Checkpoint(w=torch.zeros(3)).restore(path)
    status = Checkpoint(model=torch.nn.Linear(3, 2), other=Counter()).restore(path)
    assert status.missing == ["other"] and status.unused == ["w"]
    with pytest.raises(CheckpointMismatchError):
        status.assert_consumed()
    with pytest.raises(CheckpointNotFoundError):
        Checkpoint(w=torch.zeros(4)).restore(str(tmp_path / "nothing"))
    assert Checkpoint(w=torch.zeros(4)).restore(None).restored == []  # TF: restore(None) is a no-op
    with pytest.raises(ValueError, match="reserved"):
        Checkpoint(save_counter=1)


def test_corrupted_file_is_detected(tmp_path):
    path = Checkpoint(w=torch.ones(100)).write(str(tmp_path / "c"))
    data = bytearray(Path(path, "w.pt").read_bytes())
    data[-30] ^= 0xFF
    Path(path, "w.pt").write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError, match="SHA-256"):
        load_state(path)


# --------------------------------------------------------------------------- manager
def test_manager_keeps_the_newest_and_continues_after_a_restart(tmp_path):
    step = Counter()
    ckpt = Checkpoint(w=torch.zeros(2), step=step)
    manager = CheckpointManager(ckpt, str(tmp_path), max_to_keep=2)
    assert manager.latest_checkpoint is None and manager.restore_or_initialize() is None
    for _ in range(4):
        step.assign_add(1)
        ckpt.w += 1
        manager.save()
    assert [os.path.basename(p) for p in manager.checkpoints] == ["ckpt-3", "ckpt-4"]
    assert sorted(os.listdir(tmp_path)) == ["ckpt-3", "ckpt-4"]
    assert latest_checkpoint(str(tmp_path)) == manager.latest_checkpoint

    # A new program: finds them, restores the newest, numbering and deletion continue.
    step2 = Counter()
    ckpt2 = Checkpoint(w=torch.zeros(2), step=step2)
    manager2 = CheckpointManager(ckpt2, str(tmp_path), max_to_keep=2)
    assert manager2.restore_or_initialize().endswith("ckpt-4")
    assert step2 == 4 and torch.equal(ckpt2.w, torch.full((2,), 4.0)) and int(ckpt2.save_counter) == 4
    assert manager2.save().endswith("ckpt-5")
    assert sorted(os.listdir(tmp_path)) == ["ckpt-4", "ckpt-5"]
    assert manager2.save(checkpoint_number=100).endswith("ckpt-100")
    assert latest_checkpoint(str(tmp_path)).endswith("ckpt-100")


def test_manager_interval_and_init_fn(tmp_path):
    step = Counter()
    calls = []
    manager = CheckpointManager(
        Checkpoint(step=step),
        str(tmp_path),
        max_to_keep=None,
        step_counter=step,
        checkpoint_interval=3,
        init_fn=lambda: calls.append(1),
    )
    assert manager.restore_or_initialize() is None and calls == [1]
    saved = []
    for _ in range(7):
        step.assign_add(1)
        saved.append(manager.save() is not None)
    assert saved == [True, False, False, True, False, False, True]
    assert manager.save(check_interval=False) is not None
    with pytest.raises(ValueError, match="max_to_keep"):
        CheckpointManager(Checkpoint(step=step), str(tmp_path), max_to_keep=0)


def test_latest_checkpoint_skips_incomplete_directories(tmp_path):
    ckpt = Checkpoint(w=torch.ones(3))
    good = ckpt.save(str(tmp_path / "ckpt"))
    (tmp_path / "ckpt-9").mkdir()  # files but no manifest: a save that crashed
    (tmp_path / "ckpt-9" / "w.pt").write_bytes(b"partial")
    truncated = ckpt.save(str(tmp_path / "ckpt"))
    with open(os.path.join(truncated, "w.pt"), "r+b") as f:
        f.truncate(10)
    assert latest_checkpoint(str(tmp_path)) == good
    assert latest_checkpoint(str(tmp_path / "missing")) is None


def test_writing_over_a_checkpoint_replaces_it_whole(tmp_path):
    path = Checkpoint(w=torch.zeros(2), extra=torch.ones(1)).write(str(tmp_path / "c"))
    assert Checkpoint(w=torch.ones(2)).write(str(tmp_path / "c")) == path
    assert sorted(os.listdir(tmp_path)) == ["c"]
    assert sorted(os.listdir(path)) == ["MANIFEST.json", "MANIFEST.sha256", "w.pt"]
    assert sorted(load_state(path)) == ["save_counter", "w"] and torch.equal(load_state(path)["w"], torch.ones(2))


# --------------------------------------------------------------------------- input position
def test_input_position_resumes_mid_epoch():
    data = [[f"e{e}b{b}" for b in range(4)] for e in range(3)]
    seen, position = [], InputPosition()
    for epoch in position.epochs(3):
        for batch in position.iterate(data[epoch]):
            seen.append(batch)
            if batch == "e1b1":
                break  # "crash" after consuming e1b1
        if batch == "e1b1":
            break
    state = position.state_dict()
    assert state == {"epoch": 1, "batch": 2}
    resumed = InputPosition()
    resumed.load_state_dict(state)
    rest = [b for epoch in resumed.epochs(3) for b in resumed.iterate(data[epoch])]
    assert seen + rest == [x for epoch in data for x in epoch]
    assert (resumed.epoch, resumed.batch) == (3, 0)


def test_counter_behaves_like_an_int():
    c = Counter(2)
    assert c.assign_add(3) == 5 and c == 5 and c < 6 and c > 4 and [0, 1, 2, 3, 4, 5][c] == 5
    with pytest.raises(TypeError):
        Counter("x")


# --------------------------------------------------------------------------- sharded variables
class _ToySharded:
    """A stand-in for ParameterServerStrategy's ShardedVariable: a tensor split in row shards."""

    def __init__(self, full: torch.Tensor, num_shards: int) -> None:
        self.shards = [s.clone() for s in split_full(full, num_shards)]

    def full(self) -> torch.Tensor:
        return torch.cat(self.shards)

    def assign(self, tensor: torch.Tensor) -> None:
        self.shards = [s.clone() for s in split_full(tensor, len(self.shards))]


register_sharded_type(
    _ToySharded,
    to_full=_ToySharded.full,
    assign_full=_ToySharded.assign,
    layout=lambda v: {"axis": 0, "shards": [s.shape[0] for s in v.shards]},
)


def test_sharded_variables_restore_into_any_number_of_shards(tmp_path):
    full = torch.arange(40.0).reshape(10, 4)
    path = Checkpoint(embedding=_ToySharded(full, 2)).write(str(tmp_path / "c"))
    manifest = storage.read_manifest(path)
    assert manifest["objects"]["embedding"]["state"]["layout"]["shards"] == [5, 5]
    three, one = _ToySharded(torch.zeros(10, 4), 3), _ToySharded(torch.zeros(10, 4), 1)
    Checkpoint(embedding=three).restore(path)
    Checkpoint(embedding=one).restore(path)
    assert [s.shape[0] for s in three.shards] == [4, 3, 3]
    assert torch.equal(three.full(), full) and torch.equal(one.full(), full)
    plain = torch.zeros(10, 4)  # no sharding at all
    Checkpoint(embedding=plain).restore(path)
    assert torch.equal(plain, full) and torch.equal(load_state(path)["embedding"], full)


# --------------------------------------------------------------------------- safety
class _Payload:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
@pytest.mark.parametrize("how", ["torch_save", "raw_pickle"])
def test_code_in_a_checkpoint_is_refused_and_never_runs(tmp_path, how):
    marker = tmp_path / "pwned"
    path = Checkpoint(model=torch.nn.Linear(2, 1)).write(str(tmp_path / "c"))
    evil = {"weight": _Payload(str(marker)), "bias": torch.zeros(1)}
    if how == "torch_save":
        torch.save(evil, os.path.join(path, "model.pt"))
    else:
        Path(path, "model.pt").write_bytes(pickle.dumps(evil))
    # Make the manifest vouch for the file, as an attacker who controls the directory would.
    manifest = json.loads(Path(path, storage.MANIFEST).read_text())
    data = Path(path, "model.pt").read_bytes()
    import hashlib

    manifest["files"]["model.pt"] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    Path(path, storage.MANIFEST).write_text(json.dumps(manifest))
    storage.seal_manifest(path)  # and its digest: only the tensors-only loader stands in the way
    with pytest.raises((UnsafeCheckpointError, CorruptCheckpointError)):
        Checkpoint(model=torch.nn.Linear(2, 1)).restore(path)
    with pytest.raises((UnsafeCheckpointError, CorruptCheckpointError)):
        load_state(path)
    assert not marker.exists()
    # The payload is real: loading it the unsafe way runs it.
    unsafe = (
        "import torch; torch.load(PATH, weights_only=False)"
        if how == "torch_save"
        else "import pickle; pickle.loads(open(PATH, 'rb').read())"
    )
    subprocess.run(
        [sys.executable, "-c", unsafe.replace("PATH", repr(str(Path(path, "model.pt"))))],
        timeout=60,
        capture_output=True,
    )
    assert marker.exists()


# Modules allowed to unpickle, and why. Checkpoint loading never goes through them.
UNPICKLE_ALLOWED = {
    "phalanx/ps/pickling.py": "parameter-server wire frames, unpickled only after their cluster-secret "
    "signature is verified (security by default: docs/ARCHITECTURE.md)",
}


def _unsafe_calls(source: str, where: str) -> list[str]:
    """torch.load without weights_only=True, pickle.load(s)/Unpickler, np.load(allow_pickle=True)."""
    pickle_modules = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle"}
    problems = []

    def name_of(node: ast.AST) -> str:
        return node.id if isinstance(node, ast.Name) else getattr(node, "attr", "")

    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module:
            for alias in node.names:
                if (node.module in pickle_modules and alias.name in ("load", "loads", "Unpickler")) or (
                    node.module in ("torch", "torch.serialization") and alias.name == "load"
                ):
                    problems.append(f"{where}:{node.lineno}: from {node.module} import {alias.name}")
        if isinstance(node, ast.ClassDef):
            for base in node.bases:
                if (
                    isinstance(base, ast.Attribute)
                    and name_of(base.value) in pickle_modules
                    and base.attr == "Unpickler"
                ):
                    problems.append(f"{where}:{node.lineno}: class {node.name}({name_of(base.value)}.Unpickler)")
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
            continue
        owner_name = name_of(node.func.value)
        keywords = {k.arg: k.value for k in node.keywords}
        is_true = lambda v: isinstance(v, ast.Constant) and v.value is True  # noqa: E731
        if owner_name in pickle_modules and node.func.attr in ("load", "loads", "Unpickler"):
            problems.append(f"{where}:{node.lineno}: {owner_name}.{node.func.attr}")
        if (
            owner_name in ("torch", "serialization")
            and node.func.attr == "load"
            and not is_true(keywords.get("weights_only"))
        ):
            problems.append(f"{where}:{node.lineno}: torch.load without weights_only=True")
        if owner_name in ("np", "numpy") and node.func.attr == "load" and is_true(keywords.get("allow_pickle")):
            problems.append(f"{where}:{node.lineno}: np.load(allow_pickle=True)")
    return problems


def test_the_scan_catches_unsafe_loads():
    bad = (
        "import pickle, torch\nfrom pickle import loads\npickle.load(f)\ntorch.load(p)\n"
        "torch.load(p, weights_only=False)\ntorch.serialization.load(p)\nnp.load(p, allow_pickle=True)\n"
        "class U(pickle.Unpickler):\n    pass\n"
    )
    assert len(_unsafe_calls(bad, "x")) == 7
    assert _unsafe_calls("torch.load(p, map_location='cpu', weights_only=True)\npickle.dumps(x)\n", "x") == []


def test_no_unsafe_deserialisation_in_the_package():
    """Fails on torch.load( without weights_only=True and on unpickling anywhere in src/ (but UNPICKLE_ALLOWED)."""
    problems = []
    for file in sorted(SRC.rglob("*.py")):
        where = file.relative_to(SRC).as_posix()
        found = _unsafe_calls(file.read_text(), where)
        if where in UNPICKLE_ALLOWED:
            found = [p for p in found if "torch.load" in p]
        problems += found
    assert not problems, "unsafe deserialisation:\n" + "\n".join(problems)
    assert not any(where.startswith("phalanx/checkpoint/") for where in UNPICKLE_ALLOWED)


# --------------------------------------------------------------------------- collective rules, in one process
def test_multi_process_job_without_a_strategy_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("PHALANX_WORLD_SIZE", "2")
    with pytest.raises(CheckpointError, match="strategy.scope"):
        Checkpoint(w=torch.zeros(1)).save(str(tmp_path / "c"))


def test_checkpoint_created_in_scope_uses_that_strategy(tmp_path, monkeypatch):
    strategy = px.OneDeviceStrategy("cpu")
    with strategy.scope():
        model = torch.nn.Linear(2, 2)
        ckpt = Checkpoint(model=model)
    monkeypatch.setenv("PHALANX_WORLD_SIZE", "2")  # the captured strategy decides, not the environment
    path = ckpt.save(str(tmp_path / "c"))
    assert storage.read_manifest(path)["saved_by"] == {"strategy": "OneDeviceStrategy", "num_replicas_in_sync": 1}


def test_checkpoint_made_outside_scope_finds_the_strategy_that_owns_its_variables(tmp_path, monkeypatch):
    """As TF's tutorials do: variables in scope(), the Checkpoint after it (issue 13 item 7)."""
    strategy = px.OneDeviceStrategy("cpu")
    with strategy.scope():
        model = torch.nn.Linear(2, 2)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    monkeypatch.setenv("PHALANX_WORLD_SIZE", "2")  # would be refused if no strategy were found
    for objects in ({"model": model}, {"optimizer": optimizer}, {"w": model.weight, "step": Counter()}):
        path = Checkpoint(**objects).write(str(tmp_path / "c"))
        assert storage.read_manifest(path)["saved_by"] == {"strategy": "OneDeviceStrategy", "num_replicas_in_sync": 1}


def test_failed_write_raises(tmp_path):
    (tmp_path / "file").write_text("not a directory")
    with pytest.raises(OSError):
        Checkpoint(w=torch.zeros(1)).write(str(tmp_path / "file" / "c"))


# --------------------------------------------------------------------------- preemption, in one process
class _Stopped(Exception):
    pass


def _handler_job(directory, watcher=None, exit_codes=None):
    w, step = torch.zeros(()), Counter()
    ckpt = Checkpoint(w=w, step=step)
    manager = CheckpointManager(ckpt, str(directory), max_to_keep=1)

    def stop():
        raise _Stopped

    config = TerminationConfig(termination_watcher_fn=watcher, exit_fn=stop)
    return PreemptionCheckpointHandler(None, manager, termination_config=config), w, step


def test_preemption_saves_at_the_step_and_restores_total_run_calls(tmp_path):
    def train(w, step):
        w += 1
        step.assign_add(1)

    handler, w, step = _handler_job(tmp_path, watcher=lambda: step.value == 4)
    try:
        with pytest.raises(_Stopped):
            for _ in range(10):
                handler.run(train, w, step)
    finally:
        handler.close()
    assert handler.total_run_calls == 4 and float(w) == 4.0
    assert os.path.basename(latest_checkpoint(str(tmp_path))) == "ckpt-1"

    with _handler_job(tmp_path)[0] as resumed:  # restores in its constructor
        assert resumed.total_run_calls == 4


def test_sigterm_is_noticed_and_the_previous_handler_comes_back(tmp_path):
    before = signal.getsignal(signal.SIGTERM)
    handler = _handler_job(tmp_path)[0]
    try:
        handler.run(lambda: None)
        os.kill(os.getpid(), signal.SIGTERM)  # noted, not fatal
        with pytest.raises(_Stopped):
            handler.run(lambda: None)
        assert handler.total_run_calls == 2
    finally:
        handler.close()
    assert signal.getsignal(signal.SIGTERM) == before
    assert load_state(latest_checkpoint(str(tmp_path)))["_preemption_run_calls"] == {"value": 2}


def test_experimental_alias():
    assert px.experimental.PreemptionCheckpointHandler is PreemptionCheckpointHandler
    import phalanx.checkpoint

    assert phalanx.checkpoint.Checkpoint is Checkpoint
