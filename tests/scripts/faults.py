"""Fault injection for MultiWorkerMirroredStrategy. Usage: python faults.py OUT_DIR MODE

MODE: die (worker 1 exits at step 5), stall (worker 1 SIGSTOPs itself at step 5), ok (no fault),
uneven (worker 1 has 3 more batches; each process also reports the sockets it listens on, once its
process group is up: one fault-free job serves both checks).
Each process writes fault_<task index>.json with what happened and when.
"""

import faulthandler
import json
import os
import signal
import sys
import time

import torch

from phalanx.config import stack_signal  # PHALANX_STACK_SIGNAL, as the test harness sends

faulthandler.register(stack_signal(), all_threads=True)

import phalanx as px  # noqa: E402

out_dir, mode = sys.argv[1], sys.argv[2]
index = json.loads(os.environ["TF_CONFIG"])["task"]["index"] if "TF_CONFIG" in os.environ else 0
record = {"index": index, "pid": os.getpid()}


def save():
    with open(os.path.join(out_dir, f"fault_{index}.json"), "w") as f:
        json.dump(record, f)


try:
    record["t_start"] = time.time()  # after the imports: interpreter start-up is not phalanx's
    strategy = px.MultiWorkerMirroredStrategy(
        communication_options=px.CommunicationOptions(timeout_seconds=float(os.environ.get("FAULT_TIMEOUT", "5")))
    )
    torch.manual_seed(0)
    with strategy.scope():
        model = torch.nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(x):
        loss = px.nn.compute_average_loss(model(x).pow(2).squeeze(1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss

    batches = 8 + (3 if mode == "uneven" and index == 1 else 0)
    data = [torch.ones(4, 4) * (i + 1) for i in range(batches)]
    if mode == "uneven":
        import subprocess

        # gloo listens from the strategy's creation; the training below keeps the peer up meanwhile.
        record["ss"] = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True).stdout
    steps = 0
    for i, x in enumerate(
        strategy.experimental_distribute_dataset(data, px.InputOptions(auto_shard_policy=px.AutoShardPolicy.OFF))
    ):
        if i == 5 and index == 1 and mode in ("die", "stall"):
            record["t_fault"] = time.time()
            save()
            if mode == "die":
                os._exit(3)
            os.kill(os.getpid(), signal.SIGSTOP)
        strategy.run(step, args=(x,))
        steps += 1
    record["steps"] = steps
    record["params"] = [p.detach().reshape(-1).tolist() for p in model.parameters()]
    record["ok"] = True
    save()
except Exception as e:  # noqa: BLE001 - the test inspects what each worker raised
    record["t_error"] = time.time()
    record["error"] = type(e).__name__
    record["message"] = str(e)
    save()
    raise
