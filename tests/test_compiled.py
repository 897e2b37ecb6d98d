"""Compiled steps (torch.compile, @phalanx.function) and mixed precision under the strategies.

The property is the one every synchronous strategy keeps: the compiled (or autocast) run on N
replicas ends where the same run on one device ends, and the replicas hold identical parameters.
Most cases compile with the ``aot_eager`` backend: it runs torch.compile's graph capture and
AOTAutograd (the parts that meet phalanx's gradient hooks) without generating C++ code, which takes
a minute per process on a 2-core machine; one case runs the default ``inductor`` backend end to end.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import warnings
from pathlib import Path

import pytest
import torch

import phalanx as px

from conftest import free_ports, run_job, run_jobs, tf_config

SCRIPT = Path(__file__).parent / "scripts" / "compiled.py"


def _state(out: Path, rank: int) -> tuple[dict[str, torch.Tensor], list[float]]:
    return (
        torch.load(out / f"params_{rank}.pt", weights_only=True),
        json.loads((out / f"losses_{rank}.json").read_text()),
    )


def _load_script():
    spec = importlib.util.spec_from_file_location("_compiled_script", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def reference():
    """Plain PyTorch on one device, eager, per precision: computed here, it needs no replica process.

    fork_rng: the reference seeds the global generator, which the tests after it must not see."""
    script = _load_script()
    refs = {}
    with torch.random.fork_rng(devices=[]):
        for precision, opt in (("fp32", "adam"), ("fp32", "sgd"), ("bf16", "sgd")):
            refs[precision if opt == "adam" else f"{precision}-{opt}"] = script.reference(precision, opt)
        refs["cnn_nhwc"] = script.reference("fp32", "adam", "cnn_nhwc")
    return refs


# Every two-replica variant of the aot_eager / autocast cases, run in ONE program: MirroredStrategy
# and CentralStorageStrategy run on the same two replica processes one after the other, each variant
# with a fresh model, optimizer and strategy (process start-up, not training, is what these cost).
def _variant(kind: str, compile_: str, backend: str, precision: str, opt: str, *model: str) -> str:
    return ",".join((kind, compile_, backend, precision, opt, *model))


COMPILED_CASES = [("one_device", 1, "step"), ("mirrored", 2, "step"), ("mirrored", 2, "model"), ("central", 2, "step")]
BF16_KINDS = ["mirrored", "central"]
CHANNELS_LAST_CASES = ["none", "step"]  # eager, and the step under @phalanx.function
TWO_REPLICA_VARIANTS = (
    [_variant(k, c, "aot_eager", "fp32", "adam") for k, n, c in COMPILED_CASES if n == 2]
    + [_variant(k, "none", "-", "bf16", "sgd") for k in BF16_KINDS]
    + [_variant("mirrored", c, "aot_eager", "fp32", "adam", "cnn_nhwc") for c in CHANNELS_LAST_CASES]
)


@pytest.fixture(scope="module")
def two_replica_runs(tmp_path_factory):
    """One job for every two-replica variant: {variant: folder} and the job's output."""
    out = tmp_path_factory.mktemp("two-replicas")
    res = run_job([sys.executable, str(SCRIPT), str(out), "mixed", "2", *TWO_REPLICA_VARIANTS], timeout=480, cwd=out)
    assert res.returncode == 0, res.logs()
    return {v: out / v for v in TWO_REPLICA_VARIANTS}, res.output


def _check(out: Path, n: int, ref: tuple[dict, list], tol: float) -> float:
    ref_params, ref_losses = ref
    params0, losses0 = _state(out, 0)
    diff = max(float((params0[k] - ref_params[k]).abs().max()) for k in ref_params)
    assert diff < tol, f"max |param - one-device eager param| = {diff:.3g}"
    assert max(abs(a - b) for a, b in zip(losses0, ref_losses)) < tol * 10
    for r in range(1, n):
        other, _ = _state(out, r)
        assert all(torch.equal(params0[k], other[k]) for k in params0), f"replica {r} diverged"
    return diff


@pytest.mark.parametrize("kind,n,compile_", COMPILED_CASES)
def test_compiled_matches_one_eager_device(tmp_path, capfd, request, reference, kind, n, compile_):
    variant = _variant(kind, compile_, "aot_eager", "fp32", "adam")
    if n == 1:
        # One device needs no replica process: the script's run, here (fork_rng: it seeds the
        # global generator). A fallback to eager would warn: any warning of it fails the test.
        with torch.random.fork_rng(devices=[]), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _load_script().run_variant(str(tmp_path), n, variant)
        fallbacks = [str(w.message) for w in caught if issubclass(w.category, px.compiled.CompileFallbackWarning)]
        assert not fallbacks, fallbacks
        out, err = capfd.readouterr()
        folder, output = tmp_path / variant, out + err
    else:
        runs = request.getfixturevalue("two_replica_runs")  # the one-device case needs no job
        folder, output = runs[0][variant], runs[1]
    assert "could not compile" not in output, output  # it really ran compiled
    diff = _check(folder, n, reference["fp32"], 1e-5)
    print(f"\n{kind} x{n}, compiled {compile_}: max diff {diff:.3g}")


def test_compiled_multi_worker_mirrored(tmp_path, reference):
    workers = [f"127.0.0.1:{p}" for p in free_ports(2)]
    variant = _variant("mwms", "model", "aot_eager", "fp32", "adam")
    jobs = [
        ([sys.executable, str(SCRIPT), str(tmp_path), "mwms", "2", variant], tf_config(workers, i)) for i in range(2)
    ]
    results = run_jobs(jobs, timeout=240, cwd=tmp_path)
    assert all(r.returncode == 0 for r in results), [r.output for r in results]
    _check(tmp_path / variant, 2, reference["fp32"], 1e-5)


@pytest.mark.timeout(600)  # C++ code generation for every graph: minutes on 2 loaded cores
def test_inductor_compiled_step_under_mirrored(tmp_path, reference):
    """The default backend end to end: generated C++ kernels for forward, backward and Adam."""
    variant = _variant("mirrored", "step", "inductor", "fp32", "adam")
    res = run_job([sys.executable, str(SCRIPT), str(tmp_path), "mirrored", "2", variant], timeout=420, cwd=tmp_path)
    assert res.returncode == 0, res.logs()
    assert "could not compile" not in res.output, res.output
    _check(tmp_path / variant, 2, reference["fp32"], 1e-5)


@pytest.mark.parametrize("compile_", CHANNELS_LAST_CASES)
def test_channels_last_gradients_match_one_eager_device(two_replica_runs, reference, compile_):
    """A CNN in channels_last (PyTorch's advice for convolutions on the CPU): its weight gradients'
    bytes are not in NCHW order, so the gradient buckets must flatten and write back by index, not
    by memory order: a mix-up permutes gradient entries and moves the parameters by ~0.1 here."""
    folder = two_replica_runs[0][_variant("mirrored", compile_, "aot_eager", "fp32", "adam", "cnn_nhwc")]
    diff = _check(folder, 2, reference["cnn_nhwc"], 1e-5)
    params, _ = _state(folder, 0)
    assert params["3.weight"].is_contiguous(memory_format=torch.channels_last)  # it was saved as trained
    print(f"\nchannels_last CNN, mirrored x2, compiled {compile_}: max diff {diff:.3g}")


@pytest.mark.parametrize("kind", BF16_KINDS)
def test_bfloat16_autocast_adds_no_error_beyond_bfloat16s_own(two_replica_runs, reference, kind):
    """Under autocast, each replica's partial weight gradient (a bfloat16 matmul over its half of
    the batch) is rounded to bfloat16 before the all-reduce, where one device rounds the full sum
    once: results cannot match one device bit for bit. The property: N replicas under bfloat16 end
    about as far from one bfloat16 device as bfloat16 itself is from float32 (SGD, so that a
    wrongly scaled gradient would show: Adam would hide it)."""
    folder = two_replica_runs[0][_variant(kind, "none", "-", "bf16", "sgd")]
    params, losses = _state(folder, 0)
    one_bf16, fp32 = reference["bf16-sgd"], reference["fp32-sgd"]
    replica_error = max(float((params[k] - one_bf16[0][k]).abs().max()) for k in params)
    bf16_error = max(float((one_bf16[0][k] - fp32[0][k]).abs().max()) for k in params)
    print(
        f"\n{kind} x2 bfloat16: |N replicas - one device| {replica_error:.3g}, "
        f"|bfloat16 - float32| on one device {bf16_error:.3g}"
    )
    # Both are bfloat16 rounding effects of one order (measured 2.6e-4 vs 3.3e-4); a gradient scaled
    # wrongly moves the parameters by about one update (~1e-1 here), far beyond this bound.
    assert replica_error <= 2 * bf16_error, (replica_error, bf16_error)
    assert max(abs(a - b) for a, b in zip(losses, one_bf16[1])) < 0.02 * max(one_bf16[1])
    other, _ = _state(folder, 1)
    assert all(torch.equal(params[k], other[k]) for k in params), "replica 1 diverged"


# ---------------------------------------------------------------------- in-process: the decorator
@pytest.fixture(scope="module", autouse=True)
def _inductor_cache_dir(tmp_path_factory):
    """torch.compile writes TORCHINDUCTOR_CACHE_DIR into os.environ at its first use in a process;
    set it for this module, so that the per-test hygiene check sees no change."""
    import os

    before = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = before or str(tmp_path_factory.mktemp("inductor"))
    yield
    if before is None:
        os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)


def test_function_compiles_the_replica_function_once():
    strategy = px.OneDeviceStrategy("cpu")
    with strategy.scope():
        model = torch.nn.Linear(4, 1)
    compiled_calls = []

    def counting_backend(gm, example_inputs):
        compiled_calls.append(gm)
        return gm.forward

    @px.function(backend=counting_backend)
    def step(x):
        return strategy.reduce("SUM", strategy.run(lambda t: model(t).sum(), args=(x,)), axis=None)

    eager = model(torch.ones(3, 4)).sum()
    for _ in range(3):
        assert torch.allclose(step(torch.ones(3, 4)), eager)
    assert len(compiled_calls) == 1, "the replica function was compiled once and reused"


def test_function_falls_back_to_eager_with_one_warning():
    strategy = px.OneDeviceStrategy("cpu")
    with strategy.scope():
        model = torch.nn.Linear(4, 1)

    def broken_backend(gm, example_inputs):
        raise RuntimeError("this backend cannot compile anything")

    @px.function(backend=broken_backend)
    def step(x):
        return strategy.run(lambda t: model(t).sum(), args=(x,))

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        results = [step(torch.ones(2, 4)) for _ in range(3)]
    fallbacks = [w for w in caught if issubclass(w.category, px.compiled.CompileFallbackWarning)]
    assert len(fallbacks) == 1, [str(w.message) for w in caught]
    assert "this backend cannot compile anything" in str(fallbacks[0].message)
    assert fallbacks[0].filename == __file__, fallbacks[0].filename  # the user's line, not phalanx's
    assert all(torch.allclose(r, model(torch.ones(2, 4)).sum()) for r in results)


def test_function_without_strategy_run_compiles_the_whole_function():
    seen = []

    def backend(gm, example_inputs):
        seen.append(gm)
        return gm.forward

    @px.function(backend=backend)
    def f(x):
        return torch.sin(x) * 2

    x = torch.arange(4.0)
    assert torch.equal(f(x), torch.sin(x) * 2)  # first call: eager, learns there is no strategy.run
    assert torch.equal(f(x), torch.sin(x) * 2)
    assert len(seen) == 1
    assert f.python_function(x).equal(torch.sin(x) * 2)


def test_function_rejects_mode_with_options():
    with pytest.raises(px.compiled.CompileOptionsError, match="mode"):
        px.function(lambda: None, mode="max-autotune", options={"trace.enabled": True})


def test_importing_phalanx_leaves_torch_compile_unloaded():
    """torch.compile's machinery costs 3-5 s to import and sets TORCHINDUCTOR_CACHE_DIR: a program
    that never compiles must not pay for it (every replica process imports phalanx)."""
    import subprocess

    code = (
        "import sys, phalanx, phalanx.comm.reducer, phalanx.core.compiled; "
        "assert 'torch._dynamo' not in sys.modules, 'phalanx imported torch._dynamo'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
