"""Pure-logic tests of phalanx.cluster: no processes, no network I/O."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import pytest

from phalanx.cluster.detect import resolve_from_environment
from phalanx.cluster.placement import (
    TaskPlacement,
    compare_fingerprints,
    own_address_for,
    placement_from_spec,
)
from phalanx.cluster.simple import SimpleClusterResolver
from phalanx.cluster.slurm import SlurmClusterResolver, expand_hostlist
from phalanx.cluster.spec import ClusterSpec
from phalanx.cluster.tfconfig import TFConfigClusterResolver
from phalanx.cluster.torchelastic import TorchElasticClusterResolver
from phalanx.cluster.validation import parse_tf_config, split_address, validate_cluster
from phalanx.errors import ClusterSpecError, ClusterSpecMismatchError

CLUSTER = {"chief": ["c:2222"], "worker": ["w0:2222", "w1:2222"]}


def tf_config(cluster: dict, task_type: str, index: int, **extra: Any) -> dict[str, str]:
    return {"TF_CONFIG": json.dumps({"cluster": cluster, "task": {"type": task_type, "index": index}, **extra})}


def torchrun_env(**overrides: str) -> dict[str, str]:
    env = {
        "RANK": "3",
        "WORLD_SIZE": "4",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "2",
        "GROUP_RANK": "1",
        "GROUP_WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29400",
    }
    return {**env, **overrides}


def slurm_env(**overrides: str) -> dict[str, str]:
    env = {
        "SLURM_PROCID": "5",
        "SLURM_NTASKS": "8",
        "SLURM_LOCALID": "1",
        "SLURM_NODEID": "2",
        "SLURM_NNODES": "4",
        "SLURM_JOB_NODELIST": "node[01-03],gpu5",
        "SLURM_TASKS_PER_NODE": "2(x4)",
        "SLURM_JOB_ID": "4242",
    }
    return {**env, **overrides}


# --------------------------------------------------------------------------- ClusterSpec
def test_cluster_spec_dense_api() -> None:
    spec = ClusterSpec({"worker": ["w0:1", "w1:1"], "ps": ["p:1"], "chief": ["c:1"]})
    assert spec.jobs == ["chief", "ps", "worker"]
    assert spec.num_tasks("worker") == 2
    assert spec.task_indices("worker") == [0, 1]
    assert spec.task_address("worker", 1) == "w1:1"
    assert spec.job_tasks("ps") == ["p:1"]
    assert spec.as_dict() == {"chief": ["c:1"], "ps": ["p:1"], "worker": ["w0:1", "w1:1"]}
    assert repr(spec) == "ClusterSpec({'chief': ['c:1'], 'ps': ['p:1'], 'worker': ['w0:1', 'w1:1']})"
    assert bool(spec) and not ClusterSpec({})


def test_cluster_spec_sparse_and_copy() -> None:
    spec = ClusterSpec({"worker": {0: "w0:1", "2": "w2:1"}})  # JSON gives string keys
    assert spec.task_indices("worker") == [0, 2]
    assert spec.job_tasks("worker") == ["w0:1", None, "w2:1"]
    assert spec.as_dict() == {"worker": {0: "w0:1", 2: "w2:1"}}
    assert ClusterSpec(spec) == spec and spec != ClusterSpec({"worker": ["w0:1"]})


def test_cluster_spec_does_not_alias_input() -> None:
    source = {"worker": ["w0:1"]}
    spec = ClusterSpec(source)
    source["worker"].append("w1:1")
    spec.as_dict()["worker"].append("x:1")
    assert spec.num_tasks("worker") == 1


@pytest.mark.parametrize(
    ("call", "value"),
    [
        (lambda s: s.num_tasks("ps"), "ps"),
        (lambda s: s.task_address("worker", 5), "5"),
        (lambda s: s.task_indices("nope"), "nope"),
    ],
)
def test_cluster_spec_unknown_job_or_index(call: Callable[[ClusterSpec], Any], value: str) -> None:
    with pytest.raises(ValueError, match=value) as info:
        call(ClusterSpec({"worker": ["w0:1"]}))
    assert isinstance(info.value, ClusterSpecError)


@pytest.mark.parametrize("bad", [["w0:1"], {"worker": "w0:1"}, {"worker": [1]}, {"worker": {-1: "a:1"}}])
def test_cluster_spec_rejects_bad_shapes(bad: Any) -> None:
    with pytest.raises(ClusterSpecError):
        ClusterSpec(bad)


# --------------------------------------------------------------------------- addresses
@pytest.mark.parametrize(
    ("address", "expected"),
    [
        ("host:80", ("host", 80)),
        ("10.0.0.1:65535", ("10.0.0.1", 65535)),
        ("[::1]:80", ("::1", 80)),
        ("a-b.example.com:1", ("a-b.example.com", 1)),
    ],
)
def test_split_address_ok(address: str, expected: tuple[str, int]) -> None:
    assert split_address(address) == expected


@pytest.mark.parametrize(
    "address",
    ["host", "host:0", "host:65536", "host:-1", ":80", "::1:80", "grpc://h:1", "h h:1", "host:８０"],
)
def test_split_address_bad(address: str) -> None:
    with pytest.raises(ClusterSpecError, match="address"):
        split_address(address)


# --------------------------------------------------------------------------- malformed configurations (R6)
def _tf(text: str, **kw: Any) -> None:
    cluster, task_type, task_id, _ = parse_tf_config(text)
    validate_cluster(cluster, task_type, task_id, **kw)


def _cfg(cluster: Any, task: Any) -> str:
    return json.dumps({"cluster": cluster, "task": task})


def _w(i: int) -> dict[str, Any]:
    return {"type": "worker", "index": i}


MALFORMED: list[tuple[str, Callable[[], Any], str, str]] = [
    (
        "bad JSON",
        lambda: _tf('{"cluster": {"worker": ["a:1"]'),
        "TF_CONFIG",
        '{"cluster": {"worker": ["a:1"]',
    ),
    ("non-object JSON", lambda: _tf('["a:1"]'), "TF_CONFIG", '["a:1"]'),
    (
        "missing task",
        lambda: _tf(json.dumps({"cluster": {"worker": ["a:1"]}})),
        "TF_CONFIG",
        '{"cluster": {"worker": ["a:1"]}}',
    ),
    ("missing cluster", lambda: _tf(json.dumps({"task": _w(0)})), "TF_CONFIG", '{"task": {"type": "worker"'),
    ("task not an object", lambda: _tf(_cfg({"worker": ["a:1"]}, "worker")), "task", "'worker'"),
    ("index out of range", lambda: _tf(_cfg({"worker": ["a:1", "b:1"]}, _w(2))), "task.index", "2"),
    ("negative index", lambda: _tf(_cfg({"worker": ["a:1"]}, _w(-1))), "task.index", "-1"),
    (
        "non-integer index",
        lambda: _tf(_cfg({"worker": ["a:1"]}, {"type": "worker", "index": "one"})),
        "task.index",
        "one",
    ),
    ("missing index", lambda: _tf(_cfg({"worker": ["a:1"]}, {"type": "worker"})), "task.index", "None"),
    (
        "two chiefs",
        lambda: _tf(_cfg({"chief": ["a:1", "b:1"], "worker": ["c:1"]}, _w(0))),
        "cluster.chief",
        "['a:1', 'b:1']",
    ),
    (
        "two evaluators",
        lambda: _tf(_cfg({"evaluator": ["a:1", "b:1"], "worker": ["c:1"]}, _w(0))),
        "cluster.evaluator",
        "['a:1', 'b:1']",
    ),
    (
        "unknown job name",
        lambda: _tf(_cfg({"trainer": ["a:1"], "worker": ["c:1"]}, _w(0))),
        "cluster.trainer",
        "a:1",
    ),
    (
        "unknown task type",
        lambda: _tf(_cfg({"worker": ["a:1"]}, {"type": "master", "index": 0})),
        "task.type",
        "master",
    ),
    (
        "task type not in cluster",
        lambda: _tf(_cfg({"worker": ["a:1"]}, {"type": "chief", "index": 0})),
        "task.type",
        "chief",
    ),
    (
        "duplicate host:port",
        lambda: _tf(_cfg({"chief": ["a:1"], "worker": ["b:1", "A:1"]}, _w(0))),
        "cluster.worker[1]",
        "A:1",
    ),
    (
        "non-numeric port",
        lambda: _tf(_cfg({"worker": ["a:1", "b:http"]}, _w(0))),
        "cluster.worker[1]",
        "b:http",
    ),
    ("port out of range", lambda: _tf(_cfg({"worker": ["a:70000"]}, _w(0))), "cluster.worker[0]", "a:70000"),
    ("address without port", lambda: _tf(_cfg({"worker": ["a"]}, _w(0))), "cluster.worker[0]", "'a'"),
    (
        "empty worker list",
        lambda: _tf(_cfg({"chief": ["a:1"], "worker": []}, {"type": "chief", "index": 0})),
        "cluster.worker",
        "[]",
    ),
    (
        "ps with allow_ps=False",
        lambda: _tf(_cfg({"worker": ["a:1"], "ps": ["p:1"]}, _w(0)), allow_ps=False),
        "cluster.ps",
        "p:1",
    ),
    (
        "no ps with require_ps=True",
        lambda: _tf(_cfg({"worker": ["a:1"]}, _w(0)), require_ps=True),
        "cluster.ps",
        "None",
    ),
    (
        "bad rpc_layer",
        lambda: _tf(json.dumps({"cluster": {"worker": ["a:1"]}, "task": _w(0), "rpc_layer": 3})),
        "rpc_layer",
        "3",
    ),
    (
        "TF_CONFIG resolver",
        lambda: TFConfigClusterResolver(environ=tf_config({"worker": ["a:1"]}, "worker", 4)),
        "task.index",
        "4",
    ),
    (
        "non-numeric RANK",
        lambda: TorchElasticClusterResolver(environ=torchrun_env(RANK="zero")),
        "RANK",
        "zero",
    ),
    (
        "WORLD_SIZE 0",
        lambda: TorchElasticClusterResolver(environ=torchrun_env(WORLD_SIZE="0")),
        "WORLD_SIZE",
        "0",
    ),
    ("RANK >= WORLD_SIZE", lambda: TorchElasticClusterResolver(environ=torchrun_env(RANK="4")), "RANK", "4"),
    (
        "LOCAL_RANK >= LOCAL_WORLD_SIZE",
        lambda: TorchElasticClusterResolver(environ=torchrun_env(LOCAL_RANK="2")),
        "LOCAL_RANK",
        "2",
    ),
    (
        "GROUP_RANK out of range",
        lambda: TorchElasticClusterResolver(environ=torchrun_env(GROUP_RANK="7")),
        "GROUP_RANK",
        "7",
    ),
    (
        "MASTER_PORT out of range",
        lambda: TorchElasticClusterResolver(environ=torchrun_env(MASTER_PORT="99999")),
        "MASTER_PORT",
        "99999",
    ),
    (
        "empty MASTER_ADDR",
        lambda: TorchElasticClusterResolver(environ=torchrun_env(MASTER_ADDR=" ")),
        "MASTER_ADDR",
        "' '",
    ),
    (
        "SLURM_PROCID >= SLURM_NTASKS",
        lambda: SlurmClusterResolver(environ=slurm_env(SLURM_PROCID="8")),
        "SLURM_PROCID",
        "8",
    ),
    (
        "nodelist vs SLURM_NNODES",
        lambda: SlurmClusterResolver(environ=slurm_env(SLURM_JOB_NODELIST="n[1-2]")),
        "SLURM_JOB_NODELIST",
        "n[1-2]",
    ),
    (
        "malformed nodelist",
        lambda: SlurmClusterResolver(environ=slurm_env(SLURM_JOB_NODELIST="n[1-")),
        "SLURM_JOB_NODELIST",
        "n[1-",
    ),
    (
        "no SLURM_JOB_ID and no MASTER_PORT",
        lambda: SlurmClusterResolver(environ=slurm_env(SLURM_JOB_ID="")),
        "SLURM_JOB_ID",
        "''",
    ),
    (
        "detect: bad SLURM_NTASKS",
        lambda: resolve_from_environment(slurm_env(SLURM_NTASKS="many")),
        "SLURM_NTASKS",
        "many",
    ),
    (
        "local_rank >= local_world_size",
        lambda: SimpleClusterResolver(CLUSTER, task_type="worker", task_id=0).placement(
            local_world_size=2, local_rank=2
        ),
        "local_rank",
        "2",
    ),
]


@pytest.mark.parametrize(("case", "make", "key", "value"), MALFORMED, ids=[m[0] for m in MALFORMED])
def test_malformed_configuration(case: str, make: Callable[[], Any], key: str, value: str) -> None:
    start = time.perf_counter()
    with pytest.raises(ClusterSpecError) as info:
        make()
    elapsed = time.perf_counter() - start
    message = str(info.value)
    assert info.value.key == key, message
    assert f"{key}=" in message and value in message, message
    assert "HINT: " in message, message
    assert elapsed < 0.1, f"{case}: took {elapsed * 1000:.1f} ms"


def test_malformed_table_is_large_enough() -> None:
    assert len(MALFORMED) >= 12


# --------------------------------------------------------------------------- valid configurations
def test_validate_accepts_good_clusters() -> None:
    ps_cluster = {"chief": ["c:1"], "worker": ["w0:1", "w1:1"], "ps": ["p0:1", "p1:1"]}
    assert validate_cluster(ps_cluster, "ps", 1, require_ps=True).num_tasks("ps") == 2
    assert validate_cluster({"worker": ["w0:1"]}, "evaluator", 0)  # TF lets the evaluator stay outside
    assert validate_cluster({"worker": ["[::1]:1", "[::1]:2"]}, "worker", 1, allow_ps=False)
    assert validate_cluster({"worker": {0: "a:1", 3: "b:1"}}, "worker", 3)


def test_parse_tf_config_coerces_string_index_like_tf() -> None:
    text = json.dumps({"cluster": CLUSTER, "task": {"type": "worker", "index": "1"}, "rpc_layer": "grpc"})
    assert parse_tf_config(text) == (CLUSTER, "worker", 1, "grpc")


# --------------------------------------------------------------------------- TF_CONFIG placement
def test_tf_config_chief_and_two_workers_ranks_consistent() -> None:
    tasks = [("chief", 0, "c"), ("worker", 0, "w0"), ("worker", 1, "w1")]
    placements = []
    for task_type, index, host in tasks:
        resolver = TFConfigClusterResolver(environ=tf_config(CLUSTER, task_type, index))
        for local_rank in range(2):
            p = resolver.placement(local_world_size=2, local_rank=local_rank)
            assert p.bind_addr == host and p.task_name == f"{task_type}:{index}"
            placements.append(p)
    assert [p.rank for p in placements] == list(range(6))
    assert [p.node_rank for p in placements] == [0, 0, 1, 1, 2, 2]
    assert {(p.world_size, p.num_nodes, p.master_addr, p.master_port) for p in placements} == {(6, 3, "c", 2222)}
    assert len({json.dumps(p.fingerprint()) for p in placements}) == 1
    assert [p.is_chief for p in placements] == [True] + [False] * 5
    assert placements[0].describe_rank(3) == "worker:0 (rank 3)"
    assert placements[0].describe_rank(5) == "worker:1 (rank 5)"


def test_tf_config_resolver_api() -> None:
    env = tf_config(CLUSTER, "worker", 1, rpc_layer="grpc", environment="cloud")
    r = TFConfigClusterResolver(environ=env)
    assert (r.task_type, r.task_id, r.rpc_layer, r.environment) == ("worker", 1, "grpc", "cloud")
    assert r.master() == "grpc://w1:2222"
    assert r.master("chief", 0, rpc_layer="http") == "http://c:2222"
    assert r.cluster_spec() == ClusterSpec(CLUSTER)
    r.task_type, r.task_id = "chief", 0
    assert r.placement().rank == 0
    overridden = TFConfigClusterResolver(task_type="worker", task_id=0, rpc_layer="", environment="x", environ=env)
    assert (overridden.task_id, overridden.master(), overridden.environment) == (0, "w0:2222", "x")


def test_tf_config_unset_means_local_run() -> None:
    r = TFConfigClusterResolver(environ={})
    assert not r.cluster_spec() and r.master() == ""
    p = r.placement(local_world_size=2, local_rank=1)
    assert (p.rank, p.world_size, p.num_nodes, p.master_port) == (1, 2, 1, 0)


def test_ps_and_evaluator_are_outside_the_sync_group() -> None:
    cluster = {"chief": ["c:1"], "worker": ["w0:1"], "ps": ["p0:7"]}
    ps = TFConfigClusterResolver(environ=tf_config(cluster, "ps", 0)).placement()
    assert (ps.rank, ps.bind_addr, ps.master_addr, ps.world_size, ps.in_sync_group) == (
        -1,
        "p0",
        "c",
        2,
        False,
    )
    ev = placement_from_spec(ClusterSpec({"worker": ["127.0.0.1:1"]}), "evaluator", 0)
    assert ev.rank == -1 and ev.bind_addr == "127.0.0.1"


def test_simple_resolver_sparse_workers_and_accelerators() -> None:
    r = SimpleClusterResolver(
        {"worker": {0: "a:1", 5: "b:1"}},
        master="a:1",
        task_type="worker",
        task_id=5,
        num_accelerators={"GPU": 4},
        rpc_layer="grpc",
    )
    p = r.placement(local_world_size=4, local_rank=3)
    assert (p.rank, p.world_size, p.node_rank, p.describe_rank(6)) == (7, 8, 1, "worker:5 (rank 6)")
    assert r.master() == "grpc://a:1" and r.num_accelerators() == {"GPU": 4}
    assert set(SimpleClusterResolver({}).num_accelerators()) == {"GPU"}


# --------------------------------------------------------------------------- torchrun / Slurm placement
def test_torchelastic_placement_from_env() -> None:
    r = TorchElasticClusterResolver(environ=torchrun_env())
    p = r.placement(local_world_size=8, local_rank=5)  # ignored: torchrun sets them
    assert (p.task_name, p.rank, p.world_size, p.local_rank, p.local_world_size) == ("worker:1", 3, 4, 1, 2)
    assert (p.node_rank, p.num_nodes, p.master_addr, p.master_port, p.bind_addr) == (
        1,
        2,
        "127.0.0.1",
        29400,
        "127.0.0.1",
    )
    assert r.master() == "127.0.0.1:29400" and r.cluster_spec().task_address("worker", 0) == "127.0.0.1:29400"
    assert p.describe_rank(0) == "worker:0 (rank 0)"


def test_torchelastic_per_node_env_like_pytorchjob() -> None:
    env = {"RANK": "1", "WORLD_SIZE": "3", "MASTER_ADDR": "127.0.0.1"}
    p = TorchElasticClusterResolver(environ=env).placement(local_world_size=2, local_rank=1)
    assert (p.rank, p.world_size, p.node_rank, p.num_nodes, p.master_port) == (3, 6, 1, 3, 29500)


def test_slurm_placement_from_env() -> None:
    r = SlurmClusterResolver(environ=slurm_env())
    p = r.placement()
    assert (p.task_name, p.rank, p.world_size, p.local_rank, p.local_world_size) == ("worker:2", 5, 8, 1, 2)
    assert (p.num_nodes, p.master_addr, p.master_port) == (4, "node01", 15000 + 4242 % 20000)
    assert r.cluster_spec().job_tasks("worker") == [
        "node01:19242",
        "node02:19242",
        "node03:19242",
        "gpu5:19242",
    ]
    assert SlurmClusterResolver(environ=slurm_env(MASTER_PORT="1234")).placement().master_port == 1234


@pytest.mark.parametrize(
    ("hostlist", "hosts"),
    [
        ("node[01-03,7],gpu5", ["node01", "node02", "node03", "node7", "gpu5"]),
        ("solo", ["solo"]),
        ("a[8-10]", ["a8", "a9", "a10"]),
        ("r[1-2]-n[0-1]", ["r1-n0", "r1-n1", "r2-n0", "r2-n1"]),
        ("x[001-002],y[3]", ["x001", "x002", "y3"]),
    ],
)
def test_expand_hostlist(hostlist: str, hosts: list[str]) -> None:
    assert expand_hostlist(hostlist) == hosts


@pytest.mark.parametrize("hostlist", ["", "a[", "a]", "a[3-1]", "a[x]", "a,,b", "a[[1]]"])
def test_expand_hostlist_rejects(hostlist: str) -> None:
    with pytest.raises(ClusterSpecError, match="SLURM_JOB_NODELIST"):
        expand_hostlist(hostlist)


# --------------------------------------------------------------------------- detection
@pytest.mark.parametrize(
    ("env", "kind"),
    [
        ({}, None),
        ({"TF_CONFIG": "  "}, None),
        (tf_config(CLUSTER, "worker", 0), TFConfigClusterResolver),
        ({**tf_config(CLUSTER, "worker", 0), **torchrun_env()}, TFConfigClusterResolver),
        (torchrun_env(), TorchElasticClusterResolver),
        ({**torchrun_env(), **slurm_env()}, TorchElasticClusterResolver),
        (slurm_env(), SlurmClusterResolver),
        ({"SLURM_PROCID": "0", "SLURM_NTASKS": "1"}, None),
        ({"RANK": "0", "WORLD_SIZE": "2"}, None),
    ],
)
def test_resolve_from_environment(env: dict[str, str], kind: type | None) -> None:
    resolver = resolve_from_environment(env)
    assert (resolver is None) if kind is None else isinstance(resolver, kind)


# --------------------------------------------------------------------------- fingerprints (R7)
def _placement(**changes: Any) -> TaskPlacement:
    spec = ClusterSpec(changes.pop("cluster", CLUSTER))
    return placement_from_spec(spec, "worker", 0, local_world_size=changes.pop("lws", 2))


def test_fingerprints_agree_across_tasks() -> None:
    compare_fingerprints(_placement().fingerprint(), _placement().fingerprint(), "worker:1")


@pytest.mark.parametrize(
    ("other", "field"),
    [
        ({"cluster": {"chief": ["c:2222"], "worker": ["w0:2222", "w1:2222", "w2:2222"]}}, "world_size"),
        ({"lws": 1}, "world_size"),
        ({"cluster": {"chief": ["c2:2222"], "worker": ["w0:2222", "w1:2222"]}}, "master_addr"),
        ({"cluster": {"chief": ["c:2223"], "worker": ["w0:2222", "w1:2222"]}}, "master_port"),
        ({"cluster": {"chief": ["c:2222"], "worker": ["w0:2222", "w9:2222"]}}, "cluster_digest"),
    ],
)
def test_fingerprint_mismatch_names_first_differing_field(other: dict[str, Any], field: str) -> None:
    with pytest.raises(ClusterSpecMismatchError) as info:
        compare_fingerprints(_placement().fingerprint(), _placement(**other).fingerprint(), "worker:1")
    assert info.value.field == field and info.value.other_task == "worker:1"
    assert field in str(info.value) and "worker:1" in str(info.value)


def test_fingerprint_mismatch_on_extra_field() -> None:
    mine = {**_placement().fingerprint(), "phalanx_version": "1"}
    with pytest.raises(ClusterSpecMismatchError, match="phalanx_version"):
        compare_fingerprints(mine, _placement().fingerprint(), "chief:0")


def test_own_address_for_falls_back_to_loopback() -> None:
    assert own_address_for("127.0.0.1") == "127.0.0.1"
    assert own_address_for("") == "127.0.0.1"
