"""The training script of the deployment recipes: a small MultiWorkerMirroredStrategy job.

Every process of the job runs this same file. ``MultiWorkerMirroredStrategy()`` finds the cluster
in the environment the cluster manager sets: ``TF_CONFIG`` (Kubeflow TFJob), ``RANK`` /
``WORLD_SIZE`` / ``MASTER_ADDR`` / ``MASTER_PORT`` (PyTorchJob, torchrun), the ``SLURM_*``
variables (``srun``) or ``phalanx run --nnodes``. Replace the model and data with your own.

With ``--checkpoint-dir`` the steps run through a ``PreemptionCheckpointHandler``: told to stop
(SIGTERM, or Slurm's SIGUSR1 before the time limit), every process stops at the same step, the
checkpoint is saved and the job exits with 42, for the scheduler to restart it
(``slurm-requeue.sbatch``); the restarted job resumes from that step.

    python train.py --steps 30
"""

import argparse
import hashlib
import time

import torch

import phalanx as px
import phalanx.checkpoint

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--steps", type=int, default=30, help="training steps (default: 30)")
parser.add_argument("--global-batch", type=int, default=64, help="global batch size (default: 64)")
parser.add_argument("--checkpoint-dir", help="save here when told to stop, and resume from here (default: none)")
parser.add_argument("--step-seconds", type=float, default=0.0, help="a pause after each step, to try a preemption")
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


def distributed_step(xb, yb):
    loss = strategy.reduce("SUM", strategy.run(train_step, args=(xb, yb)), axis=None)
    time.sleep(args.step_seconds)
    return loss


handler, start = None, 0
if args.checkpoint_dir:
    ckpt = phalanx.checkpoint.Checkpoint(model=model, optimizer=optimizer)
    manager = phalanx.checkpoint.CheckpointManager(ckpt, args.checkpoint_dir, max_to_keep=1)
    handler = phalanx.checkpoint.PreemptionCheckpointHandler(resolver, manager)  # restores the latest
    start = handler.total_run_calls
    if start:
        print(f"task {task}: resumed at step {start} from {manager.latest_checkpoint}", flush=True)
loss = torch.tensor(float("nan"))
for step, (xb, yb) in enumerate(strategy.experimental_distribute_dataset(batches[start:]), start):
    loss = handler.run(distributed_step, xb, yb) if handler else distributed_step(xb, yb)
    if px.is_chief() and step % 10 == 0:
        print(f"step {step:3d}  loss {float(loss):.4f}", flush=True)

digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()[:16]
print(
    f"done: task {task}, {strategy.num_replicas_in_sync} replicas, final loss {float(loss):.6f}, parameters {digest}",
    flush=True,
)
