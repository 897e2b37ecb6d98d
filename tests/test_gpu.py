"""Checks that need a CUDA GPU: float16 with GradScaler, a compiled step on the GPU, GPU placement.

CI has no GPU, so these skip there (with the reason); run them on a GPU machine with
``pytest tests/test_gpu.py``. Multi-replica NCCL runs need two GPUs and skip on one.
"""

from __future__ import annotations

import importlib.util
import json
import os

import pytest
import torch
from gpu_paths import check_shared_device, check_single_replica_collectives

import phalanx as px

try:  # at import, as test_notebook's own imports (they set variables the hygiene check would see)
    from test_notebook import SETUP, STRATEGY, Kernel, _check_fit
except pytest.skip.Exception:  # no Jupyter here
    Kernel = None

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (CI has none)")


def _data(steps: int = 6, batch: int = 32):
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(batch, 16, generator=g), torch.randn(batch, 1, generator=g)) for _ in range(steps)]


def _layers():
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))


torch.manual_seed(0)
_INITIAL = _layers().state_dict()  # made on the CPU, outside any scope


def _model():
    # The same CPU-made values everywhere, so that runs start equal whatever else drew from the
    # generator before (a scope makes a model's values as plain torch does: see the test below).
    model = _layers()
    model.load_state_dict(_INITIAL)
    return model


def _train(model, opt, data, step_fn):
    losses = []
    for x, y in data:
        losses.append(float(step_fn(x.cuda(), y.cuda())))
    return losses


def test_float16_grad_scaler_under_one_device_equals_plain_torch(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    data = _data()
    results = []
    for use_strategy in (False, True):
        strategy = px.OneDeviceStrategy("gpu:0") if use_strategy else None
        if strategy is not None:
            with strategy.scope():
                model = _model()
                opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        else:
            model = _model().cuda()
            opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        assert next(model.parameters()).is_cuda
        scaler = torch.amp.GradScaler("cuda", init_scale=2.0**12)
        count = [0]

        def step(x, y):
            with torch.autocast("cuda", dtype=torch.float16):
                out = model(x)
            loss = ((out.float() - y) ** 2).mean()
            if count[0] == 2:
                loss = loss * float("inf")  # the scaler must skip this step and halve its scale
            count[0] += 1
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            return loss

        run = (lambda x, y: strategy.run(step, args=(x, y))) if strategy is not None else step
        for x, y in data:
            run(x.cuda(), y.cuda())
        results.append(([p.detach().cpu() for p in model.parameters()], scaler.get_scale()))
    (plain, plain_scale), (px_params, px_scale) = results
    assert plain_scale == px_scale == 2.0**11  # the overflow step was skipped, the scale halved once
    assert all(torch.equal(a, b) for a, b in zip(plain, px_params))


def test_compiled_step_on_gpu_matches_eager(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    # Inductor sets these for Triton at its first GPU compile; kept so that they are put back after.
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    for name in ("TRITON_PTXAS_PATH",):
        monkeypatch.setenv(name, os.environ.get(name, ""))
        if not os.environ[name]:
            monkeypatch.delenv(name)
    data = _data()
    finals = {}
    for compiled in (False, True):
        strategy = px.OneDeviceStrategy("gpu:0")
        with strategy.scope():
            model = _model()
            opt = torch.optim.Adam(model.parameters(), lr=0.01)

        def train_step(x, y):
            loss = ((model(x) - y) ** 2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            return loss

        def distributed_step(x, y):
            return strategy.reduce("SUM", strategy.run(train_step, args=(x, y)), axis=None)

        if compiled:
            distributed_step = px.function(distributed_step)
        for x, y in data:
            distributed_step(x.cuda(), y.cuda())
        finals[compiled] = [p.detach().cpu() for p in model.parameters()]
    diff = max(float((a - b).abs().max()) for a, b in zip(finals[False], finals[True]))
    assert diff < 1e-5, diff


def test_mirrored_default_takes_every_visible_gpu():
    strategy = px.MirroredStrategy()
    try:
        assert strategy.num_replicas_in_sync >= 1
        with strategy.scope():
            layer = torch.nn.Linear(2, 2)
        assert layer.weight.is_cuda
    finally:
        strategy.close()


def test_a_model_built_in_a_gpu_scope_starts_as_plain_torch_with_the_same_seed():
    """Issue 44: initial weights do not depend on the device a strategy builds them for."""
    torch.manual_seed(123)
    plain = _layers().to("cuda")
    for strategy in (px.OneDeviceStrategy("gpu:0"), px.MirroredStrategy(["gpu:0"])):
        torch.manual_seed(123)
        with strategy.scope():
            model = _layers()
        assert all(p.is_cuda for p in model.parameters())
        for (name, a), b in zip(plain.state_dict().items(), model.state_dict().values()):
            assert torch.equal(a, b), name
        strategy.close()
    # Opting in to creation on the device, with torch's own idiom, uses the device's generator.
    torch.manual_seed(123)
    strategy = px.OneDeviceStrategy("gpu:0")
    with strategy.scope(), torch.device(strategy.extended.device):
        on_device = _layers()
    assert on_device[0].weight.is_cuda
    assert not torch.equal(on_device[0].weight, plain[0].weight)


def test_a_module_built_inside_run_lands_on_the_replica_gpu():
    strategy = px.OneDeviceStrategy("gpu:0")
    built = {}

    def step(x):
        if "layer" not in built:
            built["layer"] = torch.nn.Linear(4, 2)  # created on the CPU; the capture moves it
        return built["layer"](x)

    out = strategy.run(step, args=(torch.ones(3, 4, device="cuda"),))
    assert built["layer"].weight.is_cuda and out.is_cuda


def test_mirrored_and_central_storage_on_one_gpu_run_the_nccl_path(tmp_path):
    """World size 1 with its process group built anyway: gradients, guard and reductions over NCCL."""
    check_single_replica_collectives(tmp_path, backend="nccl", device="cuda")


def test_two_replica_processes_share_one_gpu_over_gloo(tmp_path):
    """The multi-process CUDA path without NCCL: equal to one device, the guard read one step late."""
    check_shared_device(tmp_path, device="cuda", late_by=1)


def test_notebook_with_cuda_initialised_spawns_its_replicas_and_trains_on_the_gpu(tmp_path):
    """The seed notebook's path on a GPU machine: a kernel that used CUDA first cannot fork replicas.

    phalanx must pick the spawn start by itself (nothing forces it here), the multi-replica fit
    must equal one device, a GPU strategy in the same kernel trains on the GPU, and a cell that
    fails leaves the kernel and its replicas usable.
    """
    # Found, not imported: importing Keras here (and what it imports on a GPU image) would change
    # this process's environment; the kernel imports it.
    if Kernel is None or importlib.util.find_spec("keras") is None:
        pytest.skip("needs jupyter_client, ipykernel and keras")
    out = tmp_path / "out"
    out.mkdir()
    kernel = Kernel(tmp_path)
    try:
        kernel.ok(SETUP.format(out=str(out)), timeout=180)
        kernel.ok("on_gpu = torch.ones(2, device='cuda') * 2; torch.cuda.synchronize()")
        started = kernel.ok(STRATEGY, timeout=180)
        assert "(spawn)" in started["stderr"], started["stderr"]
        _check_fit(kernel, out)
        trained = kernel.ok(
            "gpu = phalanx.OneDeviceStrategy('gpu:0')\n"
            "with gpu.scope():\n"
            "    gpu_model = build()\n"
            "gpu_model.fit(X, Y, epochs=1, batch_size=32, shuffle=False, verbose=0)\n"
            "print('DEVICE', gpu_model.trainable_weights[0].value.device)"
        )
        assert "DEVICE cuda" in trained["stdout"], trained
        failed = kernel.run("strategy.run(lambda: 1 / 0)")
        assert failed["status"] == "error" and failed["error"][0] == "ZeroDivisionError", failed
        after = kernel.ok("strategy.reduce('sum', strategy.run(lambda: torch.ones(1)), axis=None)")
        assert "tensor([2.])" in after["results"][0], after
        kernel.ok("strategy.close()")
    finally:
        kernel.shutdown()


def test_an_elastic_job_on_a_gpu_loses_a_replica_and_takes_a_replacement_back(tmp_path, script):
    """Issue 48 on a GPU: three replica processes share it over gloo (one GPU cannot hold several
    NCCL ranks), replica 2 is SIGKILLed at step 30, the two survivors go on, and the replacement
    phalanx run starts joins with the live replicas' state (CUDA tensors: variables, Adam's moments).
    The one-device reference runs on the CPU: cuBLAS sums in another order than the CPU's, so
    the comparison allows 1e-4 (the members among themselves: bit-identical)."""
    from test_elastic import JOIN, check_rejoined, elastic_run

    env = {"MWMS": "1", "RING": "1", "PHALANX_SHM": "0"}
    res = elastic_run(tmp_path, script, "-n", "3", "--min-nproc", "2", env=env, timeout=240, body=JOIN, fresh=True)
    assert res.returncode == 0, res.logs()
    assert "replica 3 started to replace it; it joins at a step boundary" in res.output, res.output
    check_rejoined(tmp_path, script, [0, 1, 3], joiner=3, tol=1e-4)
    assert {json.loads((tmp_path / f"join_{m}.json").read_text())["device"] for m in (0, 1, 3)} == {"cuda:0"}
