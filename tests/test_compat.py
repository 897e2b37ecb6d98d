"""One test per shim of phalanx._compat: a torch, Keras or CPython upgrade that breaks one fails here."""

from __future__ import annotations

import datetime
import importlib.util
import os
import subprocess
import sys

import pytest
import torch

from phalanx._compat import torch as compat_torch


def test_version_counter_grows_with_in_place_writes():
    t = torch.zeros(3)
    before = compat_torch.version_counter(t)
    t.add_(1)
    assert compat_torch.version_counter(t) > before
    t + 1  # not in place
    assert compat_torch.version_counter(t) == before + 1


def test_queue_backward_callback_runs_after_every_gradient():
    seen = []
    w = torch.nn.Parameter(torch.ones(2))
    w.register_post_accumulate_grad_hook(
        lambda p: compat_torch.queue_backward_callback(lambda: seen.append(p.grad.clone()))
    )
    (w * 3).sum().backward()
    assert len(seen) == 1 and torch.equal(seen[0], torch.full((2,), 3.0))


def test_will_accumulate_tells_backward_from_autograd_grad():
    p, q = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(2))
    nodes = {id(p): compat_torch.accumulation_node(p), id(q): compat_torch.accumulation_node(q)}
    assert compat_torch.accumulation_node(p) is nodes[id(p)]  # the same node while it is held
    seen = []
    for t in (p, q):
        t.register_hook(
            lambda g, t=t: seen.append(
                (compat_torch.current_graph_task_id(), compat_torch.will_accumulate(nodes[id(t)]))
            )
        )
    assert compat_torch.current_graph_task_id() == -1  # outside backward
    loss = (p * q).sum()
    loss.backward(retain_graph=True)
    assert [a for _, a in seen] == [True, True] and seen[0][0] == seen[1][0] != -1
    seen.clear()
    loss.backward(inputs=[p], retain_graph=True)  # q's gradient is neither computed nor accumulated
    assert [a for _, a in seen] == [True]
    seen.clear()
    torch.autograd.grad(loss, [p, q])  # hooks run, nothing is accumulated
    assert [a for _, a in seen] == [False, False]
    assert compat_torch.tracing() is False


def test_fsdp_parameters_pairs_each_shard_with_the_parameter_autograd_accumulates_into():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    cache_dir = os.environ.get("TORCHINDUCTOR_CACHE_DIR")  # FSDP2's first pass sets it
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = torch.nn.Linear(3, 2)
        fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
        pairs = compat_torch.fsdp_parameters(model)
        assert [s for s, _ in pairs] == list(model.parameters())  # the sharded ones, in order
        assert all(g is None for _, g in pairs)  # nothing gathered before the first forward
        seen = []
        model(torch.ones(1, 3)).sum().backward()
        pairs = compat_torch.fsdp_parameters(model)
        assert [tuple(g.shape) for _, g in pairs] == [(2, 3), (2,)]  # whole, gathered
        for _, g in pairs:
            g.register_post_accumulate_grad_hook(lambda t: seen.append(t))
        model(torch.ones(1, 3)).sum().backward()
        assert [id(t) for t in seen] == [id(g) for _, g in reversed(pairs)]  # the same objects, kept
    finally:
        dist.destroy_process_group()
        if cache_dir is None:
            os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)


def test_pytree_walks_nested_structures():
    leaves, spec = compat_torch.pytree.tree_flatten({"a": (1, 2), "b": [3]})
    assert leaves == [1, 2, 3] and compat_torch.pytree.tree_unflatten(leaves, spec) == {"a": (1, 2), "b": [3]}


def test_gloo_options_bind_the_given_address():
    opts = compat_torch.gloo_options(datetime.timedelta(seconds=7), "127.0.0.1")
    assert opts._timeout == datetime.timedelta(seconds=7) and len(opts._devices) == 1


@pytest.mark.skipif(not hasattr(torch.distributed, "ProcessGroupNCCL"), reason="this torch has no NCCL")
def test_nccl_options_carry_the_timeout():
    assert compat_torch.nccl_options(datetime.timedelta(seconds=9))._timeout == datetime.timedelta(seconds=9)


def test_run_exit_handlers_runs_atexit_handlers_once():
    code = (
        "import atexit, os\nfrom phalanx._compat.python import run_exit_handlers\n"
        "atexit.register(lambda: print('handler ran', flush=True))\nrun_exit_handlers()\nos._exit(0)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.count("handler ran") == 1


def test_hook_before_thread_pools_exit_runs_while_pools_still_take_work():
    # concurrent.futures first imported AFTER the hook is registered (gRPC does so lazily, in a
    # server's thread): the hook must still run before the pools shut down.
    code = (
        "import sys\nfrom phalanx._compat.python import register_before_thread_pools_exit\n"
        "def hook():\n"
        "    import concurrent.futures.thread as t\n"
        "    print('pools shut when the hook ran:', t._shutdown, flush=True)\n"
        "register_before_thread_pools_exit(hook)\n"
        "import concurrent.futures\nconcurrent.futures.ThreadPoolExecutor(1).submit(int).result()\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout == "pools shut when the hook ran: False\n", out.stdout + out.stderr


def test_main_thread_frame_is_where_the_main_thread_is_seen_from_another_thread():
    import threading

    from phalanx._compat.python import main_thread_frame

    seen = []
    worker = threading.Thread(target=lambda: seen.append(main_thread_frame()))
    worker.start()
    worker.join()  # the main thread waits here, in this test function
    caller = seen[0]  # the main thread's innermost frame (in Thread.join), not the worker's
    assert caller is not None
    while caller is not None and caller.f_code.co_name != (
        "test_main_thread_frame_is_where_the_main_thread_is_seen_from_another_thread"
    ):
        caller = caller.f_back
    assert caller is not None


def test_run_module_as_main_runs_the_module_in_main_as_python_m_does(tmp_path):
    (tmp_path / "mod_probe.py").write_text(
        "import sys, pickle\nclass C: pass\n"
        "print(__name__, sys.argv[0].endswith('mod_probe.py'), sys.modules['__main__'].C is C, len(pickle.dumps(C())) > 0)\n"
    )
    code = "import sys\nsys.argv = ['-m']\nfrom phalanx._compat.python import run_module_as_main\nrun_module_as_main('mod_probe')\n"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True, cwd=tmp_path
    )
    fresh = subprocess.run(
        [sys.executable, "-m", "mod_probe"], capture_output=True, text=True, timeout=60, cwd=tmp_path
    )
    assert out.stdout == fresh.stdout == "__main__ True True True\n"


KERAS = importlib.util.find_spec("keras") is not None


@pytest.mark.skipif(not KERAS, reason="Keras is not installed")
def test_keras_shims_in_a_keras_process():
    # In a subprocess: importing Keras sets environment variables the hygiene fixture refuses.
    code = (
        "import keras\nfrom phalanx._compat import keras as ck\n"
        "opt = keras.optimizers.SGD(learning_rate=0.25)\n"
        "assert float(getattr(ck.learning_rate(opt), 'value', ck.learning_rate(opt))) == 0.25\n"
        "sched = keras.optimizers.schedules.ExponentialDecay(0.1, 10, 0.5)\n"
        "assert ck.learning_rate(keras.optimizers.SGD(learning_rate=sched)) is sched\n"
        "m = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])\n"
        "assert ck.initial_epoch(m) is None\n"
        "ck.set_initial_epoch(m, 3)\nassert ck.initial_epoch(m) == 3\n"
        "assert [type(l).__name__ for l in ck.direct_sublayers(m)] == ['InputLayer', 'Dense']\n"
        "assert ck.direct_sublayers(object()) is None and not ck.is_uninitialized(m.layers[0].kernel)\n"
        "with keras.StatelessScope():\n    v = keras.Variable(keras.initializers.Zeros(), shape=(2,))\n"
        "    assert ck.is_uninitialized(v)\n"
        "    ck.set_initializer(v, lambda shape, dtype=None: keras.ops.ones(shape))\n"
        "assert keras.ops.convert_to_numpy(v).tolist() == [1.0, 1.0]\n"
        "acc = keras.optimizers.SGD(0.1, gradient_accumulation_steps=2)\n"
        "for _ in range(3):\n    ck.count_optimizer_step(acc)\n"
        "assert int(acc.iterations) == 1 and int(opt.iterations) == 0\n"
        "ck.count_optimizer_step(opt)\nassert int(opt.iterations) == 1\n"
        "assert ck.optimizer_variables(opt) == []\nopt.build(m.trainable_variables)\n"
        "assert [v.path for v in ck.optimizer_variables(opt)] == [v.path for v in m.trainable_variables]\n"
        "import torch\nassert torch.device(ck.current_device()).type == ('cuda' if torch.cuda.is_available() else 'cpu')\n"
        "with keras.device('meta'):\n    assert str(ck.current_device()) == 'meta'\n"
    )
    env = {**os.environ, "KERAS_BACKEND": "torch"}
    subprocess.run([sys.executable, "-c", code], env=env, timeout=120, check=True)


def test_compile_falls_back_per_frame_runs_an_uncompilable_frame_eagerly(monkeypatch, tmp_path):
    import logging

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))  # torch.compile would set it otherwise

    def failing_backend(gm, example_inputs):
        raise RuntimeError("no backend here")

    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("torch._dynamo.convert_frame")
    logger.addHandler(handler)
    try:
        f = torch.compile(lambda x: x * 2 + 1, backend=failing_backend)
        with compat_torch.compile_falls_back_per_frame():
            assert torch.equal(f(torch.ones(2)), torch.full((2,), 3.0))
    finally:
        logger.removeHandler(handler)
    assert any(r.getMessage().startswith("WON'T CONVERT") for r in records)


def test_untraced_runs_eagerly_when_first_called_while_compiling(monkeypatch, tmp_path):
    """The shim's contract: a function wrapped before torch.compile was imported runs outside the
    trace, every call. (Its failure with a graph break around the call, 'NoneType' object is not
    callable, is reproduced by tests/test_fully_sharded.py's step under @phalanx.function.)"""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))  # torch.compile would set it otherwise
    seen = []

    def hook(x):
        seen.append(torch.compiler.is_compiling())  # a side effect dynamo cannot put in a graph
        return x

    wrapped = compat_torch.untraced(hook)
    f = torch.compile(lambda x: wrapped(x * 2) + 1, backend="eager")
    for _ in range(2):
        assert torch.equal(f(torch.ones(2)), torch.full((2,), 3.0))
    assert seen == [False, False]  # run eagerly, outside the trace, every time
