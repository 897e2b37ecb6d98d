"""The public contract without processes: process identity, global hooks, side tables, registries."""

from __future__ import annotations

import gc
import json
import pickle

import pytest
import torch

import phalanx as px
from phalanx import hooks
from phalanx._sidetable import IdentityTable
from phalanx.core.extended import InputSharding
from phalanx.core.variable_sync import owner_of
from phalanx.ps import pickling

# The first torch.optim optimizer of a process sets TORCHINDUCTOR_CACHE_DIR (torch's lazy imports);
# make that happen at collection, not inside a test the hygiene fixture watches.
torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.0)


@pytest.fixture
def no_live_strategy(monkeypatch):
    """Forgets the strategies earlier tests of this process left open."""
    import phalanx.core.strategy

    monkeypatch.setattr(phalanx.core.strategy, "_LIVE", [])


def test_process_identity_outside_any_strategy_is_a_single_process(monkeypatch, no_live_strategy):
    for var in ("TF_CONFIG", "RANK", "WORLD_SIZE", "MASTER_ADDR", "SLURM_PROCID", "SLURM_NTASKS", "PHALANX_RANK"):
        monkeypatch.delenv(var, raising=False)
    assert (px.process_index(), px.num_processes(), px.is_chief()) == (0, 1, True)
    px.barrier()


def test_process_identity_from_the_launchers_environment(monkeypatch, no_live_strategy):
    monkeypatch.setenv(
        "TF_CONFIG", json.dumps({"cluster": {"worker": ["a:1", "b:2", "c:3"]}, "task": {"type": "worker", "index": 2}})
    )
    assert (px.process_index(), px.num_processes(), px.is_chief()) == (2, 3, False)
    monkeypatch.setenv(
        "TF_CONFIG",
        json.dumps(
            {"cluster": {"chief": ["c:1"], "worker": ["a:1"], "ps": ["p:1"]}, "task": {"type": "ps", "index": 0}}
        ),
    )
    assert not px.is_chief()
    monkeypatch.delenv("TF_CONFIG")
    for k, v in {
        "PHALANX_RANK": "1",
        "PHALANX_WORLD_SIZE": "2",
        "PHALANX_LOCAL_RANK": "1",
        "PHALANX_LOCAL_WORLD_SIZE": "2",
        "PHALANX_MASTER_ADDR": "127.0.0.1",
        "PHALANX_MASTER_PORT": "1",
    }.items():
        monkeypatch.setenv(k, v)
    assert (px.process_index(), px.num_processes(), px.is_chief()) == (1, 2, False)


def test_process_identity_follows_the_live_strategy_after_its_scope_ends(monkeypatch, no_live_strategy):
    monkeypatch.setenv(
        "TF_CONFIG", json.dumps({"cluster": {"worker": ["a:1", "b:2"]}, "task": {"type": "worker", "index": 1}})
    )
    strategy = px.OneDeviceStrategy("cpu")
    with strategy.scope():
        pass
    # A live strategy answers (one process here), not the environment's TF_CONFIG.
    assert (px.process_index(), px.num_processes(), px.is_chief()) == (0, 1, True)
    strategy.close()
    assert px.process_index() == 1  # closed: back to the environment


def test_extended_contract_on_one_device():
    strategy = px.OneDeviceStrategy("cpu")
    ext = strategy.extended
    assert ext.process_index == ext.replica_id == 0 and ext.num_replicas_in_sync == ext.num_processes == 1
    assert ext.device == torch.device("cpu") and str(ext.local_device) == "cpu:0"
    assert ext.input_sharding == InputSharding(1, 0, False)
    t = torch.tensor([1.0, 2.0])
    assert torch.equal(ext.all_reduce([t], "SUM")[0], t)
    ext.broadcast([t])
    assert torch.equal(ext.all_gather(t, 0), t)
    ext.barrier()
    assert ext.container_strategy is strategy
    with strategy.scope():
        layer = torch.nn.Linear(2, 1)
    # Every strategy marks what its scope created: a Checkpoint made outside scope() finds it.
    assert owner_of(layer.weight) is ext
    strategy.run(lambda: None)
    assert ext.step == 1
    assert ext.state_to_save(layer) is None
    ext.after_restore(layer)


def test_global_hooks_are_listed_and_removable():
    strategy = px.OneDeviceStrategy("cpu")
    with strategy.scope():
        torch.nn.Linear(1, 1)
    assert {"phalanx.core.capture.parameter", "phalanx.core.capture.buffer"} <= set(hooks.installed())
    assert hooks.remove("phalanx.core.capture.parameter")
    assert "phalanx.core.capture.parameter" not in hooks.installed()
    with strategy.scope():  # the next capture installs it again
        torch.nn.Linear(1, 1)
    assert "phalanx.core.capture.parameter" in hooks.installed()
    with pytest.raises(ValueError, match="unknown global hook kind"):
        hooks.install("x", "no_such_kind", print)


def test_identity_table_keys_tensors_by_identity_and_forgets_dead_ones():
    table: IdentityTable[str] = IdentityTable()
    a, b = torch.zeros(3), torch.zeros(3)  # equal values, different objects
    table[a] = "a"
    assert table.get(b) is None and table[a] == "a"
    del a
    gc.collect()
    assert len(table) == 0


class _Thing:
    def __init__(self, key: str) -> None:
        self.key = key


def _to_ref(obj, extended):
    return obj.key if obj.key != "by-value" else None


def _from_ref(worker, payload, run):
    return ("resolved", payload, worker, run)


def test_pickling_references_are_registered_not_hard_coded():
    pickling.register_reference("test-thing", _Thing, _to_ref, _from_ref)
    assert "test-thing" in pickling.registered_kinds()
    ref = pickling.reference_to(_Thing("k"), extended=None)
    assert ref == (pickling.EXTENSION, __name__, "test-thing", "k")
    assert pickling.reference_to(_Thing("by-value"), extended=None) is None
    assert pickling.reference_to(object(), extended=None) is None
    assert pickling.resolve_reference(ref, "worker", "run") == ("resolved", "k", "worker", "run")
    with pytest.raises(pickle.UnpicklingError, match="no reference of kind"):
        pickling.resolve_reference((pickling.EXTENSION, __name__, "unknown-kind", None), None, None)


def _in_process_cluster():
    """``(transport, task)``: ``task(job)`` builds the ParameterServerStrategy of ``job``:0 of one
    in-process cluster (a chief, a parameter server and a worker), serving when asked to."""
    from phalanx.cluster import SimpleClusterResolver
    from phalanx.ps.parameter_server_strategy import ParameterServerStrategy
    from phalanx.ps.transport import InProcessTransport

    transport = InProcessTransport()
    spec = {"chief": ["127.0.0.1:1000"], "ps": ["127.0.0.1:1100"], "worker": ["127.0.0.1:1200"]}

    def task(job: str) -> ParameterServerStrategy:
        return ParameterServerStrategy(
            SimpleClusterResolver(spec, task_type=job, task_id=0),
            rpc_timeout=2.0,
            cluster_secret="serve-test-secret-0123456789",
            transport=transport,
            serve_and_exit=False,
        )

    return transport, task


def test_a_server_task_serves_until_shutdown_and_returns():
    # The explicit serve entry point (TF's Server.join()): no process exit, control comes back.
    import threading

    from phalanx.errors import ContextError

    transport, task = _in_process_cluster()
    servers = [task("ps"), task("worker")]
    threads = [threading.Thread(target=s.serve, daemon=True) for s in servers]
    for t in threads:
        t.start()
    try:
        chief = task("chief")  # waits for the parameter server to answer
        with pytest.raises(ContextError, match="serve was called on the chief"):
            chief.serve()
        chief.close()  # the chief shuts the cluster down
        for t in threads:
            t.join(timeout=10)
        assert not any(t.is_alive() for t in threads), "serve() did not return after the shutdown"
    finally:
        transport.close()


def test_a_worker_still_starting_when_the_chief_ends_the_cluster_is_stopped_too():
    # A worker warms torch.optim up before it serves (1.5 s or more on a busy host): a chief that
    # ends the cluster meanwhile must still reach it, not leave it serving until its orphan timeout.
    import threading
    import time

    transport, task = _in_process_cluster()
    ps = threading.Thread(target=task("ps").serve, daemon=True)
    ps.start()
    worker = task("worker")
    late = threading.Thread(target=lambda: (time.sleep(1.0), worker.serve()), daemon=True)
    try:
        chief = task("chief")  # waits for the parameter server only
        late.start()  # the worker starts serving a second after the chief begins to stop the cluster
        chief.close()
        for t in (ps, late):
            t.join(timeout=10)
        assert not late.is_alive(), "the late worker never got the chief's shutdown"
        assert not ps.is_alive()
    finally:
        transport.close()


def test_tf_compatibility_parameters_without_effect_warn():
    strategy = px.OneDeviceStrategy("cpu")
    with pytest.warns(UserWarning, match=r"Strategy.run\(options=...\)"):
        strategy.run(lambda: None, options=object())

    def step():
        ctx = px.get_replica_context()
        with pytest.warns(UserWarning, match="all_reduce"):
            ctx.all_reduce("SUM", torch.ones(1), options=object())
        with pytest.warns(UserWarning, match="all_gather"):
            ctx.all_gather(torch.ones(1), 0, options=object())

    strategy.run(step)


def test_the_strategy_matrix_names_each_configuration_once():
    import sys as _sys

    import strategies

    assert type(strategies.make("one_device")).__name__ == "OneDeviceStrategy"
    with pytest.raises(KeyError, match="no strategy configuration 'nope'"):
        strategies.make("nope")
    assert set(strategies.SYNCHRONOUS) <= set(strategies.COMBINATIONS)
    mwms = strategies.COMBINATIONS["multi_worker_2"]
    assert mwms.command("s.py", "a") == [_sys.executable, "-m", "phalanx.cli", "run", "-n", "2", "s.py", "a"]
    ps = strategies.COMBINATIONS["parameter_server_2ps_2workers"]
    assert ps.command("s.py")[-5:] == ["--ps", "2", "--workers", "2", "s.py"]
    assert strategies.COMBINATIONS["mirrored_cpu_2"].command("s.py") == [_sys.executable, "s.py"]
