"""ParameterServerStrategy pieces without processes: partitioners, the wire, sharded variables, and the
coordinator's semantics on an in-process cluster (the production services over a fake transport)."""

from __future__ import annotations

import time

import pytest
import torch

pytest.importorskip("cloudpickle")

import phalanx as px
from phalanx.cluster import SimpleClusterResolver
from phalanx.errors import ClusterSpecError
from phalanx.ps import wire
from phalanx.ps.client import RemoteTask
from phalanx.ps.errors import (
    AuthenticationError,
    CancelledError,
    ClusterSecretError,
    ParameterServerUnavailableError,
    ProtocolError,
)
from phalanx.ps.partitioners import (
    FixedShardsPartitioner,
    MaxSizePartitioner,
    MinSizePartitioner,
    num_shards_for,
    shard_sizes,
)
from phalanx.ps.remote_variables import Shard, ShardedVariable, VariableSpec, join_values, split_value
from phalanx.ps.testing import InProcessCluster
from phalanx.ps.transport import InProcessTransport, ServiceError, TransportError
from phalanx.ps.variable_server import ParameterServerService

SECRET = b"unit-test-secret-0123456789"


@pytest.fixture(scope="module", autouse=True)
def _torch_optim_imported():
    # The first torch.optim optimizer imports torch._dynamo, which sets TORCHINDUCTOR_CACHE_DIR; do it
    # before the per-test environment check starts.
    torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)


# ------------------------------------------------------------------------------------ partitioners
def test_partitioners_follow_tf():
    f32 = torch.float32
    assert FixedShardsPartitioner(2)((10, 3), f32) == [2, 1]
    assert FixedShardsPartitioner(5)((3,), f32) == [3]
    assert MinSizePartitioner(min_shard_bytes=4, max_shards=2)((6, 1), f32) == [2, 1]  # TF's docstring examples
    assert MinSizePartitioner(min_shard_bytes=4, max_shards=10)((6, 1), f32) == [6, 1]
    assert MaxSizePartitioner(max_shard_bytes=4)((6, 1), f32) == [6, 1]
    assert MaxSizePartitioner(max_shard_bytes=4, max_shards=2)((6, 1), f32) == [2, 1]
    assert MaxSizePartitioner(max_shard_bytes=1024)((6, 1), f32) == [1, 1]
    assert shard_sizes(10, 3) == [4, 3, 3] and shard_sizes(6, 6) == [1] * 6
    assert num_shards_for(FixedShardsPartitioner(4), (), f32) == 1  # scalars are never split
    with pytest.raises(ValueError, match="positive integer"):
        FixedShardsPartitioner(0)
    with pytest.raises(ValueError, match=r"\[k, 1, \.\.\.\]"):
        num_shards_for(lambda shape, dtype: [1, 2], (4, 4), f32)


@pytest.mark.parametrize(
    "shape,dtype,partitioner",
    [
        ((10, 4), torch.float32, FixedShardsPartitioner(3)),
        ((7,), torch.int64, MaxSizePartitioner(max_shard_bytes=16)),
        ((9, 2, 3), torch.bfloat16, MinSizePartitioner(min_shard_bytes=20, max_shards=4)),
        ((5, 3), torch.float64, FixedShardsPartitioner(5)),
    ],
)
def test_sharded_values_split_and_join_exactly(shape, dtype, partitioner):
    value = (torch.randn(shape) * 100).to(dtype)
    sizes = shard_sizes(shape[0], num_shards_for(partitioner, shape, dtype))
    starts = [sum(sizes[:j]) for j in range(len(sizes))]
    spec = VariableSpec(
        "v",
        shape,
        wire.dtype_name(dtype),
        True,
        "parameter",
        tuple(Shard(j % 2, f"v/part_{j}", s, n) for j, (s, n) in enumerate(zip(starts, sizes))),
    )
    parts = split_value(value, spec)
    assert [p.shape[0] for p in parts] == [t.shape[0] for t in torch.tensor_split(value, len(sizes))]
    assert torch.equal(join_values(parts, spec), value)
    assert VariableSpec.from_json(spec.to_json()) == spec


def test_sharded_variable_round_trip_through_parameter_servers():
    with InProcessCluster(num_ps=2, num_workers=1, variable_partitioner=FixedShardsPartitioner(3)) as cluster:
        with cluster.strategy.scope():
            emb = torch.nn.Embedding(10, 4)  # 10 rows -> shards of 4, 3, 3 on ps 0, 1, 0
            bias = torch.nn.Parameter(torch.zeros(()))  # noqa: F841 - not registered: not a variable
        handle = cluster.strategy.extended.remote_variable(emb.weight)
        assert isinstance(handle, ShardedVariable)
        assert [v.shape[0] for v in handle.variables] == [4, 3, 3]
        assert [v.device[:25] for v in handle.variables] == [
            "/job:ps/replica:0/task:0/"[:25],
            "/job:ps/replica:0/task:1/"[:25],
            "/job:ps/replica:0/task:0/"[:25],
        ]
        assert torch.equal(handle.read_value(), emb.weight.detach())
        new = torch.randn(10, 4)
        handle.assign(new)
        assert torch.equal(handle.read_value(), new)
        on_servers = [cluster.ps[int(v.device.split("task:")[1][0])].value(v.name) for v in handle.variables]
        assert all(torch.equal(a, b) for a, b in zip(on_servers, torch.tensor_split(new, 3)))
        cluster.strategy.extended.pull_variables()
        assert torch.equal(emb.weight.detach(), new)
        from phalanx.checkpoint.sharded_variables import is_sharded

        assert is_sharded(handle) and handle._phalanx_layout_() == {"axis": 0, "shards": [4, 3, 3]}


# ------------------------------------------------------------------------------------ wire and surface
def _call(service, method, frame):
    """``frame`` (a wire.Frame, or raw bytes) sent to ``service``; the verified reply."""
    chunks = frame.chunks() if isinstance(frame, wire.Frame) else [frame]
    return wire.Verifier(SECRET).decode(
        method, list(service.handle(method, chunks, "ipv4:10.1.2.3:4444")), reply_to=frame.head
    )


def test_wire_round_trip_and_refusals():
    tensors = [
        torch.randn(3, 2),
        torch.arange(5),
        torch.tensor(True),
        torch.randn(2).to(torch.bfloat16),
        torch.empty(0, 3),
    ]
    signer = wire.Signer(SECRET, "chief:0")
    frame = signer.encode("apply", {"keys": ["a"]}, tensors, [b"blob"]).to_bytes()
    msg = wire.Verifier(SECRET).decode("apply", [frame])
    assert msg.header == {"keys": ["a"]} and msg.blobs == [b"blob"]
    assert all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(msg.tensors, tensors))
    head_len = len(frame) - signer.encode("apply", {"keys": ["a"]}, tensors, [b"blob"]).head.body_len - 16  # the tag
    in_header, in_blob = bytearray(frame), bytearray(frame)
    in_header[head_len + 8 + 3] ^= 1
    blob_at = frame.index(b"blob")
    in_blob[blob_at] ^= 1
    for bad, method in (
        (bytes(in_header), "apply"),
        (bytes(in_blob), "apply"),
        (frame, "read"),
        (b"\x80\x04junk", "apply"),
    ):
        with pytest.raises(AuthenticationError):
            wire.Verifier(SECRET).decode(method, [bad])
    with pytest.raises(AuthenticationError):  # a call is not a reply
        wire.Verifier(SECRET).decode("apply", [frame], reply_to=wire.Head(0, bytes(16), 1, 0.0, 0))
    with pytest.raises(ProtocolError):
        signer.encode("read", {}, [torch.zeros(2, dtype=torch.float8_e4m3fn)])


def test_cluster_secret_is_required():
    with pytest.raises(ClusterSecretError, match="unset"):
        wire.cluster_secret(environ={})
    with pytest.raises(ClusterSecretError, match="at least 16"):
        wire.cluster_secret(environ={"PHALANX_CLUSTER_SECRET": "short"})
    assert wire.cluster_secret(environ={"PHALANX_CLUSTER_SECRET": "x" * 16}) == b"x" * 16
    spec = {"chief": ["127.0.0.1:1"], "worker": ["127.0.0.1:2"], "ps": ["127.0.0.1:3"]}
    with pytest.raises(ClusterSecretError):
        px.ParameterServerStrategy(SimpleClusterResolver(spec, task_type="chief", task_id=0), cluster_secret="")


def test_cluster_spec_is_validated_before_any_connection():
    with pytest.raises(ClusterSpecError, match="ps"):
        px.ParameterServerStrategy(
            SimpleClusterResolver({"chief": ["h:1"], "worker": ["h:2"]}, task_type="chief", task_id=0),
            cluster_secret="x" * 16,
        )
    with pytest.raises(ClusterSpecError, match="cluster"):
        px.ParameterServerStrategy(SimpleClusterResolver({}), cluster_secret="x" * 16)


def test_parameter_server_exposes_only_its_operations():
    service = ParameterServerService(0, SECRET)
    signer = wire.Signer(SECRET, "chief:0")
    for name in ("os.system", "builtins.eval", "_op_ping", "__init__"):
        with pytest.raises(ServiceError) as e:
            service.handle(name, signer.encode(name, {}).chunks(), "test")
        assert e.value.code == "unimplemented"
    hub = InProcessTransport()
    hub.serve("127.0.0.1:9", service)
    with pytest.raises(TransportError) as e:
        hub.connect("127.0.0.1:9", "phalanx.ParameterServer").call("os.system", [b""], None)
    assert e.value.code == "unimplemented"
    with pytest.raises(ServiceError) as e:  # a signed request carrying a blob: a PS unpickles nothing
        service.handle("create", signer.encode("create", {"vars": []}, (), [b"\x80\x04."]).chunks(), "test")
    assert e.value.code == "invalid"
    with pytest.raises(ServiceError) as e:
        service.handle("read", [b"\x80\x04\x95junk"], "test")
    assert e.value.code == "unauthenticated" and service.refused == 1


def test_transient_errors_are_retried_and_the_kth_is_a_ps_failure():
    hub = InProcessTransport()
    hub.serve("127.0.0.1:9", ParameterServerService(3, SECRET))
    task = RemoteTask("ps", 3, "127.0.0.1:9", hub, SECRET, rpc_timeout=1.0)
    hub.inject("127.0.0.1:9", "unavailable", 2)  # K - 1 = 2 blips: retried, not reported
    assert task.call("ping").header["task"] == "ps:3"
    hub.inject("127.0.0.1:9", "unavailable", 3)  # the K-th: a parameter-server failure, named
    with pytest.raises(ParameterServerUnavailableError, match="/job:ps/replica:0/task:3"):
        task.call("ping")
    assert task.call("ping").header["task"] == "ps:3"  # the count starts again after a success


# ------------------------------------------------------------------------------------ coordinator semantics
class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 2)
        self.register_buffer("steps", torch.zeros((), dtype=torch.int64))


def _batches(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, 4, generator=g), torch.randn(8, 2, generator=g)) for _ in range(n)]


def test_one_worker_equals_one_device_training_with_optimizer_state_on_the_ps():
    batches = _batches(6)
    torch.manual_seed(0)
    reference = _Net()
    ref_opt = torch.optim.Adam(reference.parameters(), lr=0.05, betas=(0.8, 0.9))
    for x, y in batches:
        loss = torch.nn.functional.mse_loss(reference.linear(x), y)
        ref_opt.zero_grad()
        loss.backward()
        ref_opt.step()
    with InProcessCluster(num_ps=2, num_workers=1) as cluster:
        torch.manual_seed(0)
        with cluster.strategy.scope():
            model = _Net()
            optimizer = torch.optim.Adam(model.parameters(), lr=0.05, betas=(0.8, 0.9))
        coordinator = cluster.coordinator()

        def step(x, y):
            loss = torch.nn.functional.mse_loss(model.linear(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()  # sends the gradients; the Adam step runs on the parameter servers
            model.steps += 1
            return loss

        values = [coordinator.schedule(step, args=b) for b in batches]
        coordinator.join()
        for p, q in zip(model.parameters(), reference.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-6)
        assert int(model.steps) == 6 and all(v.fetch().shape == () for v in values)
        assert not optimizer.state  # the chief's optimizer never stepped: its state lives on the servers
        slots = [s for ps in cluster.ps for s in ps._slots.values() if s.optimizer is not None]
        assert len(slots) == 2 and all(set(s.optimizer.state[s.value]) >= {"exp_avg", "exp_avg_sq"} for s in slots)


def test_user_error_surfaces_once_and_later_functions_are_cancelled():
    with InProcessCluster(num_ps=1, num_workers=1) as cluster:
        coordinator = cluster.coordinator()

        def slow():
            time.sleep(0.3)
            return 1

        def fail():
            raise ValueError("boom in a scheduled function")

        first, bad = coordinator.schedule(slow), coordinator.schedule(fail)
        later = [coordinator.schedule(slow) for _ in range(3)]
        with pytest.raises(ValueError, match="boom"):
            coordinator.join()
        assert cluster.workers[0].running == 0  # no function is still executing when join raises
        assert first.fetch() == 1
        with pytest.raises(ValueError):
            bad.fetch()
        for v in later:
            with pytest.raises(CancelledError, match="boom"):
                v.fetch()
        coordinator.join()  # the error was cleared: not raised again
        assert coordinator.done()
        assert coordinator.schedule(lambda: 2).fetch() == 2


def test_worker_lost_between_functions_work_moves_to_the_other_exactly_once():
    with InProcessCluster(num_ps=1, num_workers=2) as cluster:
        with cluster.strategy.scope():
            model = _Net()
        coordinator = cluster.coordinator()

        def count():
            model.steps += 1
            return 1

        assert sum(coordinator.fetch([coordinator.schedule(count) for _ in range(10)])) == 10
        cluster.kill_worker(0)
        coordinator.fetch([coordinator.schedule(count) for _ in range(20)])
        coordinator.join()
        assert int(model.steps) == 30
        cluster.restart_worker(0)
        deadline = time.monotonic() + 10
        while cluster.workers[0].last_contact == 0.0 and time.monotonic() < deadline:
            coordinator.fetch([coordinator.schedule(count) for _ in range(4)])
        assert cluster.workers[0].last_contact > 0  # the restarted worker was reconnected and given work


def test_dead_parameter_server_is_named_within_the_bound_and_shutdown_is_bounded():
    with InProcessCluster(num_ps=2, num_workers=1, rpc_timeout=1.0) as cluster:
        with cluster.strategy.scope():
            model = _Net()
        coordinator = cluster.coordinator()
        coordinator.schedule(lambda: model.steps.add_(1)).fetch()
        cluster.kill_ps(1)
        killed = time.monotonic()
        with pytest.raises(ParameterServerUnavailableError, match="/job:ps/replica:0/task:1") as e:
            while True:
                coordinator.schedule(lambda: model.steps.add_(1))
                coordinator.join()
        assert time.monotonic() - killed < 1.0 + 1.0 and e.value.index == 1
        with pytest.raises(ParameterServerUnavailableError):
            coordinator.done()  # it stays: the coordinator must be restarted
        t = time.monotonic()
        coordinator.shutdown()
        assert time.monotonic() - t < 10.0


def test_chief_writes_reach_the_servers_and_a_restarted_coordinator_reuses_variables():
    with InProcessCluster(num_ps=2, num_workers=1) as cluster:
        with cluster.strategy.scope():
            model = _Net()
        state = {k: torch.full_like(v, 3) for k, v in model.state_dict().items()}
        model.load_state_dict(state)  # e.g. restoring a checkpoint on the chief
        coordinator = cluster.coordinator()
        seen = coordinator.schedule(lambda: model.linear.weight.sum().item()).fetch()
        assert seen == 3 * 8
        counts = [len(ps.keys) for ps in cluster.ps]
        # A second chief (a restarted coordinator) on the same servers: same variables, their values kept.
        from phalanx.ps.parameter_server_strategy import ParameterServerStrategy

        chief2 = ParameterServerStrategy(
            SimpleClusterResolver(cluster.spec, task_type="chief", task_id=0),
            rpc_timeout=2.0,
            cluster_secret="in-process-test-secret-0123456789",
            transport=cluster.transport,
        )
        with chief2.scope():
            model2 = _Net()
        assert [len(ps.keys) for ps in cluster.ps] == counts
        assert torch.equal(model2.linear.weight.detach(), torch.full((2, 4), 3.0))
        chief2.extended.leave_cluster_running()  # for the first chief to stop


def test_per_worker_dataset_is_built_on_each_worker():
    with InProcessCluster(num_ps=1, num_workers=2) as cluster:
        coordinator = cluster.coordinator()

        def dataset_fn(ctx):
            return iter([(ctx.input_pipeline_id, i) for i in range(100)])

        iterator = iter(coordinator.create_per_worker_dataset(dataset_fn))
        with pytest.raises(TypeError, match="on the workers"):
            next(iterator)
        got = coordinator.fetch([coordinator.schedule(lambda it: next(it), args=(iterator,)) for _ in range(20)])
        by_worker: dict[int, list[int]] = {}
        for worker, i in got:
            by_worker.setdefault(worker, []).append(i)
        for items in by_worker.values():
            assert sorted(items) == list(range(len(items)))  # each worker reads its own iterator, in order


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)`")  # the chief's optimizer never steps
def test_hyperparameters_changed_on_the_chief_reach_the_servers():
    with InProcessCluster(num_ps=1, num_workers=1) as cluster:
        with cluster.strategy.scope():
            layer = torch.nn.Linear(2, 1)
        optimizer = torch.optim.SGD(layer.parameters(), lr=0.1, momentum=0.5)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
        coordinator = cluster.coordinator()

        def step():
            loss = layer(torch.ones(3, 2)).sum()
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(layer.parameters(), 1.0)  # local gradients: clipping works
            optimizer.step()

        lrs = []
        for _ in range(3):
            coordinator.schedule(step).fetch()
            slot = cluster.ps[0]._slots["v0"]
            lrs.append(slot.optimizer.param_groups[0]["lr"])
            scheduler.step()  # on the chief; the next function carries the new rate
        assert lrs == [0.1, 0.05, 0.025]
        assert slot.optimizer.param_groups[0]["momentum"] == 0.5


def test_phalanx_checkpoint_saves_the_chief_copy_and_restores_onto_the_servers(tmp_path):
    from phalanx.checkpoint import Checkpoint

    with InProcessCluster(num_ps=2, num_workers=1) as cluster:
        with cluster.strategy.scope():
            model = _Net()
            optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        coordinator = cluster.coordinator()

        def step():
            model.linear(torch.ones(2, 4)).sum().backward()
            optimizer.step()
            model.steps += 1

        coordinator.schedule(step)
        coordinator.join()  # the chief's copy now holds the servers' values
        saved = {k: v.clone() for k, v in model.state_dict().items()}
        path = Checkpoint(model=model).write(str(tmp_path / "ckpt"))
        coordinator.schedule(step)
        coordinator.join()
        assert not torch.equal(model.linear.weight, saved["linear.weight"])
        Checkpoint(model=model).read(path)  # restores the chief's copy; sent to the servers on schedule
        on_worker = coordinator.schedule(lambda: (model.linear.weight.detach().clone(), int(model.steps))).fetch()
        assert torch.equal(on_worker[0], saved["linear.weight"]) and on_worker[1] == 1


class _Embedder(torch.nn.Module):
    """A (10, 4) table that a partitioner splits into row shards, and a small head."""

    def __init__(self):
        super().__init__()
        self.table = torch.nn.Parameter(torch.randn(10, 4))
        self.head = torch.nn.Linear(4, 1)

    def forward(self, ids):
        return self.head(self.table[ids])


def _adam_step(model, optimizer, ids, y):
    loss = torch.nn.functional.mse_loss(model(ids), y)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()


def test_optimizer_state_on_the_servers_is_checkpointed_and_restores_into_3_shards_and_none(tmp_path):
    """Saved from 2 shards with the Adam state the servers hold; restored into 3 shards (the servers get
    the values and the state, split anew) and into plain PyTorch: bitwise equal, and the next step of
    all three is bitwise equal too."""
    from phalanx.checkpoint import Checkpoint, load_state

    g = torch.Generator().manual_seed(4)
    batches = [(torch.randint(0, 10, (6,), generator=g), torch.randn(6, 1, generator=g)) for _ in range(4)]
    ckpt_path = str(tmp_path / "ckpt")

    def cluster(num_ps, seed):
        c = InProcessCluster(num_ps=num_ps, num_workers=1, variable_partitioner=FixedShardsPartitioner(num_ps))
        torch.manual_seed(seed)
        with c.strategy.scope():
            model = _Embedder()
            optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
        return c, model, optimizer, c.coordinator()

    two, model, optimizer, coordinator = cluster(2, seed=0)
    with two:
        for ids, y in batches[:3]:
            coordinator.schedule(_adam_step, args=(model, optimizer, ids, y))
        coordinator.join()
        table = two.strategy.extended.remote_variable(model.table)
        assert isinstance(table, ShardedVariable) and [v.shape[0] for v in table.variables] == [5, 5]
        Checkpoint(model=model, optimizer=optimizer).write(ckpt_path)
        coordinator.schedule(_adam_step, args=(model, optimizer, *batches[3]))
        coordinator.join()
        expected_next = {k: v.clone() for k, v in model.state_dict().items()}
    saved = load_state(ckpt_path)
    table_state = saved["optimizer"]["state"][0]
    assert set(table_state) == {"step", "exp_avg", "exp_avg_sq"} and float(table_state["step"]) == 3
    assert table_state["exp_avg"].shape == (10, 4) and table_state["exp_avg"].abs().sum() > 0

    three, model3, optimizer3, coordinator3 = cluster(3, seed=1)
    with three:
        ext = three.strategy.extended
        table3 = ext.remote_variable(model3.table)
        assert [v.shape[0] for v in table3.variables] == [4, 3, 3]
        assert not torch.equal(table3.read_value(), saved["model"]["table"])
        Checkpoint(model=model3, optimizer=optimizer3).read(ckpt_path)
        # What the servers hold now, read back from them: values and optimizer state.
        assert torch.equal(table3.read_value(), saved["model"]["table"])
        specs = [ext.server_variables.spec_of(p) for p in model3.parameters()]
        for index, state in enumerate(ext.shard_io.read_optimizer_state(specs)):
            assert sorted(state) == sorted(saved["optimizer"]["state"][index])
            assert all(torch.equal(state[k], saved["optimizer"]["state"][index][k]) for k in state), index
        assert not optimizer3.state  # the state went to the servers, not kept on the chief
        resaved = Checkpoint(optimizer=optimizer3).write(str(tmp_path / "again"))
        again = load_state(resaved)["optimizer"]["state"]
        assert all(torch.equal(again[i][k], saved["optimizer"]["state"][i][k]) for i in again for k in again[i])
        coordinator3.schedule(_adam_step, args=(model3, optimizer3, *batches[3]))
        coordinator3.join()
        for k, v in model3.state_dict().items():
            assert torch.equal(v, expected_next[k]), k

    plain = _Embedder()
    plain_opt = torch.optim.Adam(plain.parameters(), lr=0.05)
    plain.load_state_dict(saved["model"])
    plain_opt.load_state_dict(saved["optimizer"])
    _adam_step(plain, plain_opt, *batches[3])
    for k, v in plain.state_dict().items():
        assert torch.equal(v, expected_next[k]), k


def test_several_steps_in_one_function_each_see_the_updated_variables():
    batches = _batches(6, seed=3)
    torch.manual_seed(0)
    reference = _Net()
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    for x, y in batches:
        ref_opt.zero_grad()
        torch.nn.functional.mse_loss(reference.linear(x), y).backward()
        ref_opt.step()
    with InProcessCluster(num_ps=2, num_workers=1) as cluster:
        torch.manual_seed(0)
        with cluster.strategy.scope():
            model = _Net()
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        coordinator = cluster.coordinator()

        def three_steps(chunk):
            for x, y in chunk:
                optimizer.zero_grad()
                torch.nn.functional.mse_loss(model.linear(x), y).backward()
                optimizer.step()

        coordinator.schedule(three_steps, args=(batches[:3],))
        coordinator.schedule(three_steps, args=(batches[3:],))
        coordinator.join()
        for p, q in zip(model.parameters(), reference.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-6)


def test_strategy_run_belongs_inside_scheduled_functions():
    from phalanx.errors import ContextError

    with InProcessCluster(num_ps=1, num_workers=1) as cluster:
        strategy = cluster.strategy
        with strategy.scope():
            layer = torch.nn.Linear(2, 1)
        with pytest.raises(ContextError, match="schedule"):
            strategy.run(lambda: layer(torch.ones(1, 2)))
        coordinator = cluster.coordinator()

        def replica_fn(x):
            assert px.get_replica_context() is not None
            return layer(x).sum()

        def worker_fn():
            per_replica = strategy.run(replica_fn, args=(torch.ones(3, 2),))
            return strategy.reduce("SUM", per_replica, axis=None)

        assert coordinator.schedule(worker_fn).fetch().shape == ()
        assert strategy.num_replicas_in_sync == 1 and strategy.extended.should_checkpoint
