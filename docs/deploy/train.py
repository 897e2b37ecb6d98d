"""The training script of the deployment recipes: a small MultiWorkerMirroredStrategy job.

Every process of the job runs this same file. ``MultiWorkerMirroredStrategy()`` finds the cluster
in the environment the cluster manager sets: ``TF_CONFIG`` (Kubeflow TFJob), ``RANK`` /
``WORLD_SIZE`` / ``MASTER_ADDR`` / ``MASTER_PORT`` (PyTorchJob, torchrun), the ``SLURM_*``
variables (``srun``) or ``phalanx run --nnodes``. Replace the model and data with your own.

    python train.py --steps 30
"""

import argparse
import hashlib

import torch

import phalanx as px

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--steps", type=int, default=30, help="training steps (default: 30)")
parser.add_argument("--global-batch", type=int, default=64, help="global batch size (default: 64)")
args = parser.parse_args()

strategy = px.MultiWorkerMirroredStrategy()
resolver = strategy.cluster_resolver
task = f"{resolver.task_type}:{resolver.task_id}" if resolver is not None else "local"

torch.manual_seed(0)  # the same synthetic data on every worker; each replica takes its slice
x = torch.randn(args.steps * args.global_batch, 16)
y = x @ torch.linspace(-1, 1, 16).unsqueeze(1) + 0.1 * torch.randn(len(x), 1)
batches = list(zip(x.split(args.global_batch), y.split(args.global_batch)))

with strategy.scope():
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)


def train_step(xb, yb):
    per_example = ((model(xb) - yb) ** 2).mean(dim=1)
    loss = px.nn.compute_average_loss(per_example, global_batch_size=args.global_batch)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return loss


for step, (xb, yb) in enumerate(strategy.experimental_distribute_dataset(batches)):
    loss = strategy.reduce("SUM", strategy.run(train_step, args=(xb, yb)), axis=None)
    if px.is_chief() and step % 10 == 0:
        print(f"step {step:3d}  loss {float(loss):.4f}", flush=True)

digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()[:16]
print(f"done: task {task}, {strategy.num_replicas_in_sync} replicas, final loss {float(loss):.6f}, "
      f"parameters {digest}", flush=True)
