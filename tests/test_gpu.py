"""Checks that need a CUDA GPU: float16 with GradScaler, a compiled step on the GPU, GPU placement.

CI has no GPU, so these skip there (with the reason); run them on a GPU machine with
``pytest tests/test_gpu.py``. Multi-replica NCCL runs need two GPUs and skip on one.
"""

from __future__ import annotations

import pytest
import torch

import phalanx as px

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (CI has none)")


def _data(steps: int = 6, batch: int = 32):
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(batch, 16, generator=g), torch.randn(batch, 1, generator=g)) for _ in range(steps)]


def _layers():
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))


torch.manual_seed(0)
_INITIAL = _layers().state_dict()  # made on the CPU, outside any scope


def _model():
    # Created inside a GPU strategy's scope, parameters are initialised on the GPU with the CUDA
    # generator; load the same CPU-made values everywhere so that runs start equal.
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


def test_a_module_built_inside_run_lands_on_the_replica_gpu():
    strategy = px.OneDeviceStrategy("gpu:0")
    built = {}

    def step(x):
        if "layer" not in built:
            built["layer"] = torch.nn.Linear(4, 2)  # created on the CPU; the capture moves it
        return built["layer"](x)

    out = strategy.run(step, args=(torch.ones(3, 4, device="cuda"),))
    assert built["layer"].weight.is_cuda and out.is_cuda
