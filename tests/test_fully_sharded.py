"""FullyShardedStrategy (issue 32): the same program, parameters, gradients and optimizer state split.

K steps under the sharded strategy equal K steps on one device (plain PyTorch) and under
MirroredStrategy, for SGD with momentum, Adam and AdamW, with gradient clipping, accumulation
(``no_sync``), bfloat16 autocast, a compiled model and a step under ``@phalanx.function``; each
replica holds 1/N of the state; a checkpoint written sharded on N replicas restores sharded on M,
under Mirrored, on one device and in plain PyTorch, and one written under Mirrored restores
sharded; a sharded save writes each replica's shards with torch.distributed.checkpoint, allocates
no whole tensor, and its files are verified (and never unpickled) on load; what cannot be sharded is refused with a typed error, and replicas out of step are named
by the guard.
"""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest
import torch

from conftest import has_fsdp2, run_job

SCRIPT = Path(__file__).parent / "scripts" / "sharded.py"


pytestmark = pytest.mark.skipif(not has_fsdp2(), reason="torch has no FSDP2 (torch < 2.6)")


def _script():
    spec = importlib.util.spec_from_file_location("_sharded_script", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _max_diff(a: dict, b: dict) -> float:
    assert set(a) == set(b)
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def _params(folder: Path) -> dict[str, torch.Tensor]:
    return torch.load(folder / "params.pt", weights_only=True)


_REFERENCES: dict[tuple[str, tuple[str, ...]], dict[str, torch.Tensor]] = {}


def _reference(opt: str, features: tuple[str, ...] = ()) -> dict[str, torch.Tensor]:
    """Plain PyTorch on one device (fork_rng: it seeds the global generator)."""
    key = (opt, tuple(f for f in features if f in ("clip", "accum", "bf16", "variable")))
    if key not in _REFERENCES:
        with torch.random.fork_rng(devices=[]):
            model = _script().reference(*key)
        _REFERENCES[key] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return _REFERENCES[key]


@pytest.fixture(scope="module", autouse=True)
def _adam_stepped_once():
    """Before any test's hygiene snapshot: Adam's first step in a process sets
    TORCHINDUCTOR_CACHE_DIR in os.environ, once."""
    _reference("adam")


TWO = [
    "sharded,sgd",
    "sharded,adam",
    "sharded,adamw",
    "sharded,sgd,clip",
    "sharded,adamw,accum",
    "sharded,adam,bf16",
    "mirrored,adam,bf16",
    "sharded,adam,compiled",
    "sharded,adam,function",
    "sharded,sgd,variable,accum",
    "sharded_root,adam,save",
    "sharded,adam,wide,save",
    "mirrored,adam,save",
    "mirrored,adam",
    "sharded,adam,loose",
    "sharded,adam,inrun",
    "sharded,adam,outofstep",
]


@pytest.fixture(scope="module")
def two(tmp_path_factory) -> Path:
    """Every two-replica case, one after the other in one job."""
    out = tmp_path_factory.mktemp("sharded2")
    res = run_job([sys.executable, str(SCRIPT), str(out), "2", *TWO], timeout=300, cwd=out)
    assert res.returncode == 0, res.logs()
    return out


@pytest.fixture(scope="module")
def four(tmp_path_factory, two) -> Path:
    """Four replicas: training, and restoring what two replicas saved (sharded and mirrored)."""
    out = tmp_path_factory.mktemp("sharded4")
    cases = [
        "sharded,adam",
        "sharded,adamw,accum,clip",
        "sharded,adam,wide,save",
        f"sharded,adam,from_sharded,restore={two / 'sharded_root,adam,save' / 'ckpt'}",
        f"sharded_root,adam,from_mirrored,restore={two / 'mirrored,adam,save' / 'ckpt'}",
        f"mirrored,adam,from_sharded,restore={two / 'sharded_root,adam,save' / 'ckpt'}",
    ]
    res = run_job([sys.executable, str(SCRIPT), str(out), "4", *cases], timeout=300, cwd=out)
    assert res.returncode == 0, res.logs()
    return out


# Float tolerance: Adam divides by the root of tiny second moments in its first steps, where
# summation order (slices of the batch, then a sum) moves the last bits.
TOL = {"sgd": 1e-6, "adam": 5e-5, "adamw": 5e-5}


@pytest.mark.parametrize(
    "variant",
    [
        "sharded,sgd",
        "sharded,adam",
        "sharded,adamw",
        "sharded,sgd,clip",
        "sharded,adamw,accum",
        "sharded,adam,compiled",
        "sharded,adam,function",
        "sharded,sgd,variable,accum",
    ],
)
def test_two_replicas_match_one_device(two, variant):
    _, opt, *features = variant.split(",")
    diff = _max_diff(_params(two / variant), _reference(opt, tuple(features)))
    assert diff < TOL[opt], f"{variant}: max |sharded - one device| = {diff}"


@pytest.mark.parametrize("variant", ["sharded,adam", "sharded,adamw,accum,clip"])
def test_four_replicas_match_one_device(four, variant):
    _, opt, *features = variant.split(",")
    diff = _max_diff(_params(four / variant), _reference(opt, tuple(features)))
    assert diff < TOL[opt], f"{variant}: max |sharded - one device| = {diff}"


def test_bfloat16_autocast_matches_mirrored_and_one_device(two):
    sharded, mirrored = _params(two / "sharded,adam,bf16"), _params(two / "mirrored,adam,bf16")
    assert _max_diff(sharded, mirrored) < 1e-6  # the same slices, the same bfloat16 matmuls
    # One device multiplies the whole batch at once: bfloat16 rounds differently, not wrongly.
    assert _max_diff(sharded, _reference("adam", ("bf16",))) < 3e-2


def test_sharded_matches_mirrored(two):
    assert _max_diff(_params(two / "sharded,adam"), _params(two / "mirrored,adam")) < TOL["adam"]


@pytest.mark.parametrize(("folder", "n"), [("two", 2), ("four", 4)])
def test_each_replica_holds_a_share_of_the_state(request, two, folder, n):
    """Parameters, gradients and Adam's two moments: at most 1/N of Mirrored's + 10 % per replica."""
    whole = json.loads((two / "mirrored,adam" / "memory_0.json").read_text())
    params = sum(v.numel() * 4 for v in _reference("adam").values())
    assert whole == {"params": params, "grads": params, "optimizer": 2 * params}  # the measure counts it all
    out = request.getfixturevalue(folder)
    for rank in range(n):
        mine = json.loads((out / "sharded,adam" / f"memory_{rank}.json").read_text())
        for kind in ("params", "grads", "optimizer"):
            assert 0 < mine[kind] <= whole[kind] / n * 1.10, (rank, kind, mine, whole)


@pytest.mark.parametrize(
    "variant",
    [
        "sharded,adam,from_sharded",  # saved sharded on 2 (one group), restored sharded on 4 (per layer)
        "mirrored,adam,from_sharded",  # saved sharded on 2, restored under Mirrored on 4
        "sharded_root,adam,from_mirrored",  # saved under Mirrored on 2, restored sharded on 4
    ],
)
def test_checkpoint_moves_between_replica_counts_and_strategies(four, variant):
    """Saved after 4 of 8 steps, restored, the last 4 taken: the whole run on one device."""
    diff = _max_diff(_params(four / variant), _reference("adam"))
    assert diff < TOL["adam"], f"{variant}: {diff}"


def test_sharded_checkpoint_restores_in_plain_pytorch_and_on_one_device(two, tmp_path):
    import phalanx as px
    from phalanx.checkpoint import load_state

    script = _script()
    path = two / "sharded_root,adam,save" / "ckpt"
    # Plain PyTorch: the files are the ordinary state dicts.
    state = load_state(str(path))
    model = script.make_model()
    opt = script.make_optimizer("adam", model.parameters())
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])
    with torch.random.fork_rng(devices=[]):
        batches = script.data()
        for i in range(script.STEPS_BEFORE_SAVE, script.STEPS):
            x, y = batches[i]
            (((model(x) - y) ** 2).mean(dim=1).sum() / script.GLOBAL_BATCH).backward()
            opt.step()
            opt.zero_grad()
    assert _max_diff(model.state_dict(), _reference("adam")) < TOL["adam"]
    # OneDeviceStrategy, through the same training function.
    with torch.random.fork_rng(devices=[]):
        strategy = px.OneDeviceStrategy("cpu")
        try:
            script.train(strategy, "adam", [f"restore={path}"], str(tmp_path))
        finally:
            strategy.close()
    assert _max_diff(_params(tmp_path), _reference("adam")) < TOL["adam"]


def _wide(request, n: int) -> Path:
    """The wide model's run on ``n`` replicas, saved sharded after 4 steps (one group per layer)."""
    return request.getfixturevalue({2: "two", 4: "four"}[n]) / "sharded,adam,wide,save"


def _whole_bytes(out: Path, n: int) -> int:
    """Bytes of the wide model's parameters and Adam moments, all replicas' shares together."""
    shares = [json.loads((out / f"save_memory_{rank}.json").read_text()) for rank in range(n)]
    return sum(share["params"] + share["optimizer"] for share in shares)


@pytest.mark.parametrize("n", [2, 4])
def test_a_sharded_checkpoint_holds_each_replicas_shard_in_dcp_files(request, n):
    """torch.distributed.checkpoint's files, one per replica holding only its rows; no whole-tensor file."""
    from phalanx.checkpoint import distributed

    path = _wide(request, n) / "ckpt"
    files = json.loads((path / "MANIFEST.json").read_text())["files"]
    data = {f"sharded/__{rank}_0.distcp" for rank in range(n)}
    assert data | {"sharded/.metadata", "sharded/index.json"} == {f for f in files if f.startswith("sharded/")}
    assert "model.pt" not in files, sorted(files)  # every tensor of the model is a shard
    if "optimizer.pt" in files:  # Adam's step counters (0-d, whole on every replica); the moments are shards
        steps = torch.load(path / "optimizer.pt", weights_only=True)
        assert all(t.dim() == 0 for t in steps.values()), {k: tuple(t.shape) for k, t in steps.items()}
    metadata = distributed.read_metadata(str(path))
    rows: dict[tuple[str, str], int] = {}
    for index, info in metadata.storage_data.items():
        chunks = metadata.state_dict_metadata[index.fqn].chunks
        chunk = next(c for c in chunks if tuple(c.offsets) == tuple(index.offset))
        key = (f"sharded/{info.relative_path}", index.fqn)
        rows[key] = rows.get(key, 0) + chunk.sizes[0]
    assert {f for f, _ in rows} == data
    for fqn, meta in metadata.state_dict_metadata.items():
        whole = meta.size[0]
        assert sum(rows.get((f, fqn), 0) for f in data) == whole, fqn  # every row once
        assert all(rows.get((f, fqn), 0) <= -(-whole // n) for f in data), (fqn, rows)  # no replica more than 1/N
    whole = _whole_bytes(path.parent, n)
    sizes = {f: files[f]["bytes"] for f in sorted(data)}
    print(f"N={n}: state {whole} bytes; per replica file {sizes}; metadata {files['sharded/.metadata']['bytes']}")
    assert all(size <= whole / n * 1.10 for size in sizes.values()), (whole, sizes)


@pytest.mark.parametrize("n", [2, 4])
def test_a_sharded_save_never_holds_a_whole_tensor(request, n):
    """Peak bytes of tensors allocated while saving (torch's profiler): below half this replica's
    share of the state (a gathering save allocates the whole state, N shares, and more)."""
    out = _wide(request, n)
    whole = _whole_bytes(out, n)
    for rank in range(n):
        saved = json.loads((out / f"save_memory_{rank}.json").read_text())
        assert saved["params"] + saved["optimizer"] <= whole / n * 1.10, saved  # it holds its share
        assert saved["peak"] < whole / n / 2, (rank, saved, whole)


def _copy_checkpoint(two: Path, tmp_path: Path, name: str) -> Path:
    import shutil

    copy = tmp_path / name / "ckpt"
    shutil.copytree(two / "sharded_root,adam,save" / "ckpt", copy)
    return copy


@pytest.mark.parametrize("victim", ["sharded/__1_0.distcp", "sharded/.metadata", "sharded/index.json"])
def test_a_changed_or_missing_sharded_file_is_named(two, tmp_path, victim):
    from phalanx.checkpoint import CorruptCheckpointError, latest_checkpoint, load_state

    changed = _copy_checkpoint(two, tmp_path, "changed")
    data = bytearray((changed / victim).read_bytes())
    data[len(data) // 2] ^= 0x01
    (changed / victim).write_bytes(bytes(data))
    missing = _copy_checkpoint(two, tmp_path, "missing")
    (missing / victim).unlink()
    for path in (changed, missing):
        with pytest.raises(CorruptCheckpointError) as e:
            load_state(str(path))
        assert e.value.path == str(path / victim), e.value
        assert latest_checkpoint(str(path.parent)) is None  # skipped as damaged, with a warning


def test_code_in_the_sharded_metadata_is_never_run(two, tmp_path):
    """DCP's .metadata is a pickle: phalanx never unpickles it (it reads its JSON index), so one that
    calls a function restores without running it, even with a matching digest."""
    import hashlib
    import os
    import pickle

    from phalanx.checkpoint import UnsafeCheckpointError, load_state, storage

    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    path = _copy_checkpoint(two, tmp_path, "evil")
    evil = pickle.dumps(Payload())
    (path / "sharded" / ".metadata").write_bytes(evil)
    manifest = json.loads((path / "MANIFEST.json").read_text())
    manifest["files"]["sharded/.metadata"] = {"bytes": len(evil), "sha256": hashlib.sha256(evil).hexdigest()}
    (path / "MANIFEST.json").write_text(json.dumps(manifest))
    storage.seal_manifest(str(path))  # whoever could write the files could write the digests too
    state = load_state(str(path))
    assert not marker.exists()
    assert _max_diff(state["model"], load_state(str(two / "sharded_root,adam,save" / "ckpt"))["model"]) == 0
    # The index it reads instead is checked: one that points outside the checkpoint is refused.
    index = json.loads((path / "sharded" / "index.json").read_text())
    next(iter(index["tensors"].values()))["chunks"][0]["file"] = "../../MANIFEST.json"
    data = json.dumps(index).encode()
    (path / "sharded" / "index.json").write_bytes(data)
    manifest["files"]["sharded/index.json"] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (path / "MANIFEST.json").write_text(json.dumps(manifest))
    storage.seal_manifest(str(path))
    with pytest.raises(UnsafeCheckpointError, match="MANIFEST.json"):
        load_state(str(path))


def test_a_parameter_on_no_module_is_refused(two):
    for rank in range(2):
        text = (two / "sharded,adam,loose" / f"error_{rank}.txt").read_text()
        assert text.startswith("UnsynchronizedParameterError") and "(shape (3,))" in text, text
    assert not (two / "sharded,adam,loose" / "params.pt").exists()


def test_a_module_built_inside_run_is_refused(two):
    for rank in range(2):
        text = (two / "sharded,adam,inrun" / f"error_{rank}.txt").read_text()
        assert text.startswith("ShardingError") and "Linear.weight (shape (2, 2))" in text, text


def test_replicas_out_of_step_are_named_by_the_guard(two):
    for rank in range(2):
        text = (two / "sharded,adam,outofstep" / f"error_{rank}.txt").read_text()
        assert text.startswith("ReplicaDivergenceError") and "step is 7 on replica:0" in text, text
        assert "8 on replica:1" in text, text


@pytest.mark.parametrize(("kind", "init"), [("sharded", False), ("sharded", True), ("mwms", False)])
def test_under_torchrun(tmp_path, kind, init):
    """torchrun's agent serves the store at MASTER_PORT: phalanx joins it (MultiWorkerMirrored
    too, which failed there on the port); a program that made torch's default group keeps it."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", str(SCRIPT), str(tmp_path), "env"]
    res = run_job([*cmd, kind, *(["init"] if init else [])], timeout=180, cwd=tmp_path)
    assert res.returncode == 0, res.logs()
    assert _max_diff(_params(tmp_path), _reference("adam")) < TOL["adam"]


def test_a_failing_replica_reports_its_own_traceback(tmp_path):
    """torch's init_process_group wraps sys.excepthook to prefix "[rankK]: " to each line of a
    traceback; phalanx makes the default group itself and keeps the replica's report as it was."""
    res = run_job([sys.executable, str(SCRIPT), str(tmp_path), "2", "sharded,adam,crash"], timeout=180, cwd=tmp_path)
    assert res.returncode != 0
    logs = res.logs()
    assert "RuntimeError: boom on replica 1" in logs, logs
    assert "[rank1]:" not in logs and "[rank0]:" not in logs, logs


def test_bad_arguments_are_typed():
    import phalanx as px

    for bad in (0, -3, 1.5, True, "big"):
        with pytest.raises(px.errors.ShardingError, match=re.escape(repr(bad))):
            px.FullyShardedStrategy("cpu", min_params_to_shard=bad)
    with pytest.raises(px.errors.ClusterSpecError, match="cpu:0"):
        px.FullyShardedStrategy(["cpu:0"], cluster_resolver=object())


def test_roots_over_the_same_parameters_make_one_group_and_a_partial_overlap_is_refused():
    # A Keras model loaded from a file keeps an earlier internal graph over all its weights: the
    # two containers must become one FSDP2 group (sharded twice, the first group's parameters
    # were emptied: a size-0 weight at the first step; tests/test_keras_load_model.py).
    from phalanx.errors import ShardingError
    from phalanx.strategies.fully_sharded import _one_group_per_parameter

    shared, own = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    first, model = torch.nn.Sequential(shared), torch.nn.Sequential(shared)  # the same parameters
    bigger = torch.nn.Sequential(shared, own)
    assert _one_group_per_parameter([first, model]) == [model]  # the latest seen among equals
    assert _one_group_per_parameter([bigger, first]) == [bigger]  # the one holding the most
    # Two models over one shared layer, each with a layer of its own: no one group holds both.
    left, right = torch.nn.Sequential(shared, torch.nn.Linear(2, 2)), torch.nn.Sequential(shared, own)
    with pytest.raises(ShardingError, match="share some parameters"):
        _one_group_per_parameter([left, right])
