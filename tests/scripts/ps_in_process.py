"""A parameter-server cluster whose servers run in the chief's own process (``phalanx.Server``, as
TF's tutorial does with ``tf.distribute.Server``): a few scheduled steps, then the script just ends.

    python ps_in_process.py

The test reads its output: a job that succeeded must end quietly (no traceback from gRPC's
threads, no lost workers) with exit code 0.
"""

import os
import socket

os.environ.setdefault("PHALANX_CLUSTER_SECRET", "in-process-secret-0123456789abcdef")
import torch  # noqa: E402

import phalanx  # noqa: E402


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


cluster = phalanx.ClusterSpec(
    {
        "worker": [f"127.0.0.1:{free_port()}" for _ in range(2)],
        "ps": [f"127.0.0.1:{free_port()}"],
        "chief": [f"127.0.0.1:{free_port()}"],
    }
)
for i in range(2):
    phalanx.Server(cluster, job_name="worker", task_index=i, protocol="grpc")
phalanx.Server(cluster, job_name="ps", task_index=0, protocol="grpc")
resolver = phalanx.cluster_resolver.SimpleClusterResolver(cluster, task_type="chief", task_id=0, rpc_layer="grpc")
strategy = phalanx.ParameterServerStrategy(resolver)
with strategy.scope():
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)


def step():
    def replica_fn():
        loss = model(torch.ones(8, 4)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss.detach()

    return strategy.run(replica_fn)


coordinator = phalanx.coordinator.ClusterCoordinator(strategy)
for _ in range(4):
    coordinator.schedule(step)
coordinator.join()
print(f"loss {coordinator.schedule(step).fetch():.4f}")
print("IN-PROCESS OK", flush=True)
