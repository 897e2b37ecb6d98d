"""The deployment recipes in docs/deploy/, each run as a 2-node job in Linux network namespaces.

For each recipe the test derives, from the manifest or script itself, the environment its
cluster manager would give every process (the Kubeflow training operator's TF_CONFIG and
MASTER_*/RANK variables, srun's SLURM_* variables, the shell variables of the multi-node
command), checks what phalanx's resolvers read from it, then runs the recipe's command on two
"hosts": network namespaces joined by a veth pair, each with the pod's or node's host name
(``unshare --uts``) and an /etc/hosts that resolves the others' names, as cluster DNS would.
Skipped, with the reason, where namespaces cannot be made (not root, no iproute2).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import yaml
from test_multi_host import two_hosts  # noqa: F401  (the 2-namespace fixture)

from phalanx.cluster.detect import resolve_from_environment

from conftest import run_jobs

DEPLOY = Path(__file__).resolve().parents[1] / "docs" / "deploy"
_DONE = re.compile(r"done: task (\S+), (\d+) replicas, final loss (\S+), parameters (\w+)")


class Pod:
    """One process the cluster manager starts: its host name, environment, command and directory."""

    def __init__(self, hostname: str, env: dict[str, str], command: list[str], workdir: str = "") -> None:
        self.hostname, self.env, self.command, self.workdir = hostname, env, command, workdir


def _container(replica_spec: dict) -> dict:
    return replica_spec["template"]["spec"]["containers"][0]


def _port(replica_spec: dict, name: str, default: int) -> int:
    ports = _container(replica_spec).get("ports", [])
    return next((int(p["containerPort"]) for p in ports if p.get("name") == name), default)


def tfjob_pods(manifest: dict) -> tuple[list[Pod], dict[str, int]]:
    """What the training operator gives each TFJob pod: TF_CONFIG with every replica's service."""
    name, namespace = manifest["metadata"]["name"], manifest["metadata"].get("namespace", "default")
    specs = manifest["spec"]["tfReplicaSpecs"]
    cluster = {
        rtype.lower(): [
            f"{name}-{rtype.lower()}-{i}.{namespace}.svc:{_port(spec, 'tfjob-port', 2222)}"
            for i in range(spec.get("replicas", 1))
        ]
        for rtype, spec in specs.items()
    }
    pods, names = [], {}
    for rtype, spec in specs.items():
        for i in range(spec.get("replicas", 1)):
            config = {"cluster": cluster, "task": {"type": rtype.lower(), "index": i}, "environment": "cloud"}
            c = _container(spec)
            pods.append(
                Pod(
                    f"{name}-{rtype.lower()}-{i}",
                    {"TF_CONFIG": json.dumps(config)},
                    c["command"] + c.get("args", []),
                    c.get("workingDir", ""),
                )
            )
            names[f"{name}-{rtype.lower()}-{i}.{namespace}.svc"] = len(pods) - 1
    return pods, names


def pytorchjob_pods(manifest: dict) -> tuple[list[Pod], dict[str, int]]:
    """What the training operator gives each PyTorchJob pod (master: MASTER_ADDR=localhost, rank 0)."""
    name = manifest["metadata"]["name"]
    specs = manifest["spec"]["pytorchReplicaSpecs"]
    port = _port(specs["Master"], "pytorchjob-port", 23456)
    world = sum(spec.get("replicas", 1) for spec in specs.values())
    pods, names = [], {}
    for rtype in ("Master", "Worker"):
        for i in range(specs.get(rtype, {}).get("replicas", 0)):
            master = rtype == "Master"
            env = {
                "MASTER_PORT": str(port),
                "MASTER_ADDR": "localhost" if master else f"{name}-master-0",
                "WORLD_SIZE": str(world),
                "RANK": str(0 if master else i + 1),
                "PYTHONUNBUFFERED": "1",
            }
            c = _container(specs[rtype])
            pods.append(
                Pod(f"{name}-{rtype.lower()}-{i}", env, c["command"] + c.get("args", []), c.get("workingDir", ""))
            )
            names[f"{name}-{rtype.lower()}-{i}"] = len(pods) - 1
    return pods, names


def trainjob_pods(documents: list[dict]) -> tuple[list[Pod], dict[str, int]]:
    """What Kubeflow Trainer v2 gives each node of a TrainJob run on a ClusterTrainingRuntime.

    The JobSet's replicated job ``node`` runs one pod per node, ``<job>-node-0-<index>``, under the
    headless service ``<job>``; the torch plugin sets the ``PET_*`` variables that ``torchrun``
    reads as its flags. The TrainJob's ``trainer`` overrides the runtime's node count, processes
    per node and command.
    """
    by_kind = {d["kind"]: d for d in documents}
    runtime, job = by_kind["ClusterTrainingRuntime"], by_kind["TrainJob"]
    assert job["spec"]["runtimeRef"]["name"] == runtime["metadata"]["name"], (job["spec"], runtime["metadata"])
    policy, trainer = runtime["spec"]["mlPolicy"], job["spec"].get("trainer", {})
    (node_job,) = [j for j in runtime["spec"]["template"]["spec"]["replicatedJobs"] if j["name"] == "node"]
    container = next(c for c in node_job["template"]["spec"]["template"]["spec"]["containers"] if c["name"] == "node")
    name = job["metadata"]["name"]
    nnodes = int(trainer.get("numNodes", policy.get("numNodes", 1)))
    nproc = str(trainer.get("numProcPerNode", policy.get("torch", {}).get("numProcPerNode", "auto")))
    command = trainer.get("command", container["command"]) + trainer.get("args", container.get("args", []))
    pods, names = [], {}
    for node in range(nnodes):
        env = {
            "PET_NNODES": str(nnodes),
            "PET_NPROC_PER_NODE": nproc,
            "PET_NODE_RANK": str(node),
            "PET_MASTER_ADDR": f"{name}-node-0-0.{name}",
            "PET_MASTER_PORT": "29500",  # the plugin's trainer port (ContainerTrainerPort)
            "PYTHONUNBUFFERED": "1",
        }
        pods.append(Pod(f"{name}-node-0-{node}", env, command, container.get("workingDir", "")))
        names[f"{name}-node-0-{node}.{name}"] = node
    return pods, names


def slurm_pods(script: str, job_id: int = 4242) -> tuple[list[Pod], dict[str, int]]:
    """What ``sbatch`` + ``srun`` give each task of the batch script, on nodes pxnode1..N."""
    directives = dict(re.findall(r"^#SBATCH\s+--([\w-]+)=(\S+)", script, re.M))
    nnodes, per_node = int(directives["nodes"]), int(directives.get("ntasks-per-node", "1"))
    srun = shlex.split(next(line for line in script.splitlines() if line.startswith("srun ")))[1:]
    while srun and srun[0].startswith("-"):
        srun.pop(0)
    nodelist = f"pxnode[1-{nnodes}]"
    pods, names = [], {}
    for node in range(nnodes):
        for local in range(per_node):
            env = {
                "SLURM_JOB_ID": str(job_id),
                "SLURM_JOB_NAME": directives.get("job-name", ""),
                "SLURM_NNODES": str(nnodes),
                "SLURM_NTASKS": str(nnodes * per_node),
                "SLURM_NTASKS_PER_NODE": str(per_node),
                "SLURM_TASKS_PER_NODE": f"{per_node}(x{nnodes})",
                "SLURM_JOB_NODELIST": nodelist,
                "SLURM_STEP_NODELIST": nodelist,
                "SLURM_NODEID": str(node),
                "SLURM_PROCID": str(node * per_node + local),
                "SLURM_LOCALID": str(local),
                "SLURMD_NODENAME": f"pxnode{node + 1}",
            }
            pods.append(Pod(f"pxnode{node + 1}", env, srun))
        names[f"pxnode{node + 1}"] = len(pods) - 1
    return pods, names


def multinode_pods(script: str, master_ip: str) -> tuple[list[Pod], dict[str, int]]:
    """The multi-node command as each host's shell runs it, with NODE_RANK and MASTER_ADDR set."""
    line = next(line for line in script.splitlines() if line.startswith("phalanx run"))
    command = ["bash", "-c", line.replace("phalanx run", f"{shlex.quote(sys.executable)} -m phalanx.cli run", 1)]
    nnodes = int(re.search(r"--nnodes (\d+)", line)[1])
    pods = [Pod(f"pxhost{k}", {"NODE_RANK": str(k), "MASTER_ADDR": master_ip}, command) for k in range(nnodes)]
    return pods, {f"pxhost{k}": k for k in range(nnodes)}


def _run_on_two_hosts(tmp_path: Path, hosts, pods: list[Pod], names: dict[str, int]) -> list[dict]:
    assert len(pods) == 2, [p.hostname for p in pods]
    lines = ["127.0.0.1 localhost", "::1 localhost"] + [f"{hosts[i][1]} {n}" for n, i in names.items()]
    lines += [f"{hosts[i][1]} {p.hostname}" for i, p in enumerate(pods) if p.hostname not in names]
    made = []
    try:
        for ns, _ in hosts:  # `ip netns exec` mounts /etc/netns/<ns>/hosts over /etc/hosts
            Path("/etc/netns", ns).mkdir(parents=True, exist_ok=True)
            Path("/etc/netns", ns, "hosts").write_text("\n".join(lines) + "\n")
            made.append(Path("/etc/netns", ns))
        path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"  # `python` is this Python
        jobs = []
        for (ns, _), pod in zip(hosts, pods):
            workdir = str(DEPLOY)  # the image's working directory (/app) holds the recipe's train.py
            boot = 'hostname "$0" && cd "$1" && shift 2 && exec "$@"'
            jobs.append(
                (
                    [
                        "ip",
                        "netns",
                        "exec",
                        ns,
                        "unshare",
                        "--uts",
                        "sh",
                        "-c",
                        boot,
                        pod.hostname,
                        workdir,
                        "_",
                        *pod.command,
                    ],
                    {**pod.env, "PATH": path},
                )
            )
        results = run_jobs(jobs, timeout=180, cwd=tmp_path)
    finally:
        for d in made:
            shutil.rmtree(d, ignore_errors=True)
    assert all(r.returncode == 0 for r in results), "\n".join(r.logs() for r in results)
    done = []
    for r in results:
        match = _DONE.search(r.output) or _DONE.search(r.logs())
        assert match, r.logs()
        done.append({"task": match[1], "replicas": int(match[2]), "loss": match[3], "params": match[4]})
    assert all(d["replicas"] == 2 for d in done), done
    assert done[0]["loss"] == done[1]["loss"] and done[0]["params"] == done[1]["params"], done
    return done


def _resolved(pod: Pod):
    resolver = resolve_from_environment({**pod.env})
    assert resolver is not None, pod.env
    return resolver


def test_tfjob_manifest(tmp_path, two_hosts):  # noqa: F811
    pods, names = tfjob_pods(yaml.safe_load((DEPLOY / "tfjob.yaml").read_text()))
    for i, pod in enumerate(pods):
        resolver = _resolved(pod)
        assert type(resolver).__name__ == "TFConfigClusterResolver"
        assert (resolver.task_type, resolver.task_id) == ("worker", i)
        assert resolver.cluster_spec().num_tasks("worker") == 2
    done = _run_on_two_hosts(tmp_path, two_hosts, pods, names)
    assert [d["task"] for d in done] == ["worker:0", "worker:1"]


def test_pytorchjob_manifest(tmp_path, two_hosts):  # noqa: F811
    pods, names = pytorchjob_pods(yaml.safe_load((DEPLOY / "pytorchjob.yaml").read_text()))
    for rank, pod in enumerate(pods):
        resolver = _resolved(pod)
        assert type(resolver).__name__ == "TorchElasticClusterResolver"
        placement = resolver.placement()
        assert (placement.rank, placement.world_size, placement.num_nodes) == (rank, 2, 2)
    _run_on_two_hosts(tmp_path, two_hosts, pods, names)


def test_trainjob_manifest(tmp_path, two_hosts):  # noqa: F811
    pods, names = trainjob_pods(list(yaml.safe_load_all((DEPLOY / "trainjob.yaml").read_text())))
    # phalanx reads what torchrun makes of the PET_* variables, not the variables themselves.
    assert [resolve_from_environment(pod.env) for pod in pods] == [None, None]
    done = _run_on_two_hosts(tmp_path, two_hosts, pods, names)
    assert [d["task"] for d in done] == ["worker:0", "worker:1"]


def test_slurm_batch_script(tmp_path, two_hosts):  # noqa: F811
    pods, names = slurm_pods((DEPLOY / "slurm.sbatch").read_text())
    for rank, pod in enumerate(pods):
        placement = _resolved(pod).placement()
        assert type(_resolved(pod)).__name__ == "SlurmClusterResolver"
        assert (placement.rank, placement.world_size, placement.master_addr) == (rank, 2, "pxnode1")
    _run_on_two_hosts(tmp_path, two_hosts, pods, names)


def test_multinode_command(tmp_path, two_hosts):  # noqa: F811
    pods, names = multinode_pods((DEPLOY / "multinode.sh").read_text(), master_ip=two_hosts[0][1])
    _run_on_two_hosts(tmp_path, two_hosts, pods, names)


def test_recipes_parse_without_a_cluster():
    """Pure logic, no namespaces: what each recipe gives its processes (runs where netns cannot)."""
    tf_pods, _ = tfjob_pods(yaml.safe_load((DEPLOY / "tfjob.yaml").read_text()))
    assert json.loads(tf_pods[1].env["TF_CONFIG"])["cluster"]["worker"] == [
        "phalanx-train-worker-0.default.svc:2222",
        "phalanx-train-worker-1.default.svc:2222",
    ]
    pt_pods, _ = pytorchjob_pods(yaml.safe_load((DEPLOY / "pytorchjob.yaml").read_text()))
    assert [(p.env["RANK"], p.env["MASTER_ADDR"]) for p in pt_pods] == [
        ("0", "localhost"),
        ("1", "phalanx-train-master-0"),
    ]
    tj_pods, _ = trainjob_pods(list(yaml.safe_load_all((DEPLOY / "trainjob.yaml").read_text())))
    assert [(p.hostname, p.env["PET_NODE_RANK"], p.env["PET_MASTER_ADDR"], p.env["PET_NNODES"]) for p in tj_pods] == [
        ("phalanx-train-node-0-0", "0", "phalanx-train-node-0-0.phalanx-train", "2"),
        ("phalanx-train-node-0-1", "1", "phalanx-train-node-0-0.phalanx-train", "2"),
    ]
    assert tj_pods[0].command == ["torchrun", "train.py", "--steps", "30"]
    slurm, _ = slurm_pods((DEPLOY / "slurm.sbatch").read_text())
    assert [p.command for p in slurm] == [["python", "train.py", "--steps", "30"]] * 2
    for pod in [*tf_pods, *pt_pods[1:], *slurm]:
        assert resolve_from_environment(pod.env) is not None
    assert subprocess.run(["bash", "-n", str(DEPLOY / "multinode.sh")], timeout=10).returncode == 0
