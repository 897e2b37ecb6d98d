"""Deterministic 100-step training (4 epochs x 25 global batches) that survives a crash or a preemption.

Usage: phalanx run -n 2 [--max-restarts 1] ckpt_train.py OUT_DIR MODE

MODE:
  clean    no fault: the uninterrupted reference.
  crash    worker 1 os._exit()s before step 37 on the first attempt; checkpoints every 5 steps,
           so the restarted run replays step 36 from the checkpoint of step 35.
  corrupt  the chief flips one bit in a tensor file of the latest checkpoint (step 35) and exits
           before step 37 on the first attempt; the restart must fall back to the checkpoint of
           step 30 (self-healing) and replay steps 31..36.
  preempt  worker 1 gets SIGTERM before step 37 on the first attempt; a PreemptionCheckpointHandler
           makes every worker save after step 37 and exit 42; regular checkpoints every 10 steps.

The chief appends one line per executed step to OUT_DIR/executed.log ("attempt step"), one JSON
line per start to attempts.jsonl, and writes final.pt; every worker that stops for preemption
writes preempted_<rank>.json.
"""

import faulthandler
import json
import os
import signal
import sys

import torch

from phalanx.config import stack_signal  # PHALANX_STACK_SIGNAL, as the test harness sends

faulthandler.register(stack_signal(), all_threads=True)

import phalanx as px  # noqa: E402
from phalanx.checkpoint import (  # noqa: E402
    Checkpoint,
    CheckpointManager,
    Counter,
    InputPosition,
    PreemptionCheckpointHandler,
    TerminationConfig,
)

EPOCHS, STEPS_PER_EPOCH, GLOBAL_BATCH, FEATURES, FAULT_STEP = 4, 25, 16, 8, 37


def epoch_batches(epoch):
    # Each epoch's order depends on the epoch only, so a resumed run sees the same batches.
    g = torch.Generator().manual_seed(1000 + epoch)
    x = torch.randn(STEPS_PER_EPOCH * GLOBAL_BATCH, FEATURES, generator=g)
    y = torch.sin(x.sum(1, keepdim=True))
    return [(x[i : i + GLOBAL_BATCH], y[i : i + GLOBAL_BATCH]) for i in range(0, len(x), GLOBAL_BATCH)]


def main(out, mode):
    attempt = int(os.environ.get("PHALANX_RESTART_COUNT", "0"))
    strategy = px.MultiWorkerMirroredStrategy()
    rank, chief = strategy.extended.process_index, strategy.extended.should_checkpoint
    torch.manual_seed(0)
    with strategy.scope():
        model = torch.nn.Sequential(torch.nn.Linear(FEATURES, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
        optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
        applied, position = Counter(), InputPosition()
        ckpt = Checkpoint(model=model, optimizer=optimizer, applied=applied, input=position)
    manager = CheckpointManager(ckpt, os.path.join(out, "ckpts"), max_to_keep=2)
    handler = None
    if mode == "preempt":

        def stop():
            with open(os.path.join(out, f"preempted_{rank}.json"), "w") as f:
                json.dump({"rank": rank, "total_run_calls": handler.total_run_calls, "applied": applied.value}, f)
            sys.exit(px.launch.runner.RESTART_EXIT_CODE)

        handler = PreemptionCheckpointHandler(
            strategy.cluster_resolver, manager, termination_config=TerminationConfig(exit_fn=stop)
        )
        restored = manager.latest_checkpoint
    else:
        restored = manager.restore_or_initialize()
    if chief:
        with open(os.path.join(out, "attempts.jsonl"), "a") as f:
            f.write(
                json.dumps(
                    {
                        "attempt": attempt,
                        "restored": restored,
                        "applied": applied.value,
                        "position": [position.epoch, position.batch],
                        "total_run_calls": handler.total_run_calls if handler else None,
                    }
                )
                + "\n"
            )
    log = open(os.path.join(out, "executed.log"), "a") if chief else None

    def train_step(batch):
        def step(x, y):
            loss = px.nn.compute_average_loss(((model(x) - y) ** 2).mean(1), global_batch_size=GLOBAL_BATCH)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()

        strategy.run(step, args=batch)
        applied.assign_add(1)
        if log:
            log.write(f"{attempt} {applied.value}\n")
            log.flush()

    for epoch in position.epochs(EPOCHS):
        for batch in position.iterate(strategy.experimental_distribute_dataset(epoch_batches(epoch))):
            if attempt == 0 and rank == 0 and mode == "corrupt" and applied.value + 1 == FAULT_STEP:
                damaged = os.path.join(manager.latest_checkpoint, "model.pt")
                with open(damaged, "r+b") as f:
                    f.seek(os.path.getsize(damaged) // 2)
                    byte = f.read(1)
                    f.seek(-1, os.SEEK_CUR)
                    f.write(bytes([byte[0] ^ 0x01]))  # same size: only the SHA-256 can tell
                os._exit(13)
            if attempt == 0 and rank == 1 and applied.value + 1 == FAULT_STEP:
                if mode == "crash":
                    os._exit(13)
                if mode == "preempt":
                    os.kill(os.getpid(), signal.SIGTERM)
            if handler is not None:
                handler.run(train_step, batch)
                if applied.value % 10 == 0:
                    manager.save()
            else:
                train_step(batch)
                if mode in ("crash", "corrupt") and applied.value % 5 == 0:
                    manager.save()
    if chief:
        torch.save(
            {
                "model": {k: v.clone() for k, v in model.state_dict().items()},
                "applied": applied.value,
                "optimizer": optimizer.state_dict()["state"],
            },
            os.path.join(out, "final.pt"),
        )


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
