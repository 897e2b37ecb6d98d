"""Two replicas that hang, or whose collectives part, in one of the ways of issue 47 (``HANG_MODE``).

Started by ``tests/test_hang_diagnosis.py`` as ``python hangs.py`` (self-launch), under ``phalanx
run -n 2``, or as two ``TF_CONFIG`` workers. Each line the diagnosis must name carries a marker
comment (``# @NAME``) that the test looks up. At step 5 each replica writes ``t_event_<rank>``
(the time the trouble starts) and at every step's end ``step_<rank>``.

Modes: ``sleep`` (replica 1 sleeps in its own code), ``pipe`` (replica 1 reads a pipe nobody
writes), ``extra`` (replica 1 makes one more ``strategy.reduce``), ``missing`` (replica 1 skips a
``strategy.gather``), ``shape`` (replica 1 all-reduces a tensor of another shape), ``bucket_order``
(replica 1 builds its model's layers in another order: its gradient buckets differ), ``kill``
(replica 1 is killed with SIGKILL), ``slow`` (replica 1 is slow at every step, never past the
timeout), ``chief`` (the chief evaluates alone for ``HANG_CHIEF_S`` seconds, longer than the
timeout), ``chief_declared`` (the same inside ``phalanx.wait_for_chief()``) and ``chief_dies``
(the chief is killed inside ``phalanx.wait_for_chief()``) and ``skip`` (replica 1's step raises, and its
loop goes on to the next step). The files go to
``HANG_DIR`` (default: the working directory).
"""

import faulthandler
import os
import signal
import time
from pathlib import Path

import torch

from phalanx.config import stack_signal

faulthandler.register(stack_signal(), all_threads=True)  # a hung job dumps its stacks (the harness's signal)

import phalanx as px

MODE = os.environ["HANG_MODE"]
STEPS = int(os.environ.get("HANG_STEPS", "7"))
CHIEF_S = float(os.environ.get("HANG_CHIEF_S", "8"))
SLOW_S = float(os.environ.get("HANG_SLOW_S", "0.5"))
OUT = Path(os.environ.get("HANG_DIR", "."))

if os.environ.get("TF_CONFIG"):
    strategy = px.MultiWorkerMirroredStrategy()
elif MODE == "bucket_order":  # a bucket per layer's parameters (2 packs), so that their sizes show the order
    strategy = px.MirroredStrategy(["cpu:0", "cpu:1"], cross_device_ops=px.NcclAllReduce(num_packs=2))
else:
    strategy = px.MirroredStrategy(["cpu:0", "cpu:1"])
rank = strategy.extended.process_index
torch.manual_seed(0)
with strategy.scope():
    if MODE == "bucket_order" and rank == 1:
        second = torch.nn.Linear(64, 2)  # created first here: this replica's parameters come in another order
        first = torch.nn.Linear(4, 64)
    else:
        first = torch.nn.Linear(4, 64)
        second = torch.nn.Linear(64, 2)
    model = torch.nn.Sequential(first, torch.nn.ReLU(), second)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)


def step(x, i=0):
    if MODE == "skip" and rank == 1 and i == 5:
        raise ValueError("a bad record on replica 1 only")  # @SKIP
    loss = px.nn.compute_average_loss(model(x).square().sum(1), global_batch_size=8)
    loss.backward()  # @BACKWARD
    optimizer.step()
    optimizer.zero_grad()
    return loss.reshape(1)


def evaluate(seconds):
    """The chief's own work: pure Python, running the whole time."""
    end, total = time.monotonic() + seconds, 0
    while time.monotonic() < end:
        total += sum(range(2000))  # @EVALUATE
    return total


def other_shape():
    t = torch.ones(4 if rank == 0 else 3)
    return px.get_replica_context().all_reduce("SUM", t)  # @SHAPE


read_end, _ = os.pipe()
for i in range(1, STEPS + 1):
    if i == 5:
        (OUT / f"t_event_{rank}").write_text(repr(time.time()))
        if MODE == "sleep" and rank == 1:
            time.sleep(1000)  # @SLEEP
        if MODE == "pipe" and rank == 1:
            os.read(read_end, 1)  # @PIPE
        if MODE == "kill" and rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)  # @KILL
        if MODE == "chief" and px.is_chief():
            evaluate(CHIEF_S)  # @CHIEF
        if MODE == "chief_declared":
            with px.wait_for_chief("evaluation"):  # @DECLARED
                if px.is_chief():
                    evaluate(CHIEF_S)
        if MODE == "chief_dies":
            with px.wait_for_chief("evaluation"):
                if px.is_chief():
                    time.sleep(1.0)
                    os.kill(os.getpid(), signal.SIGKILL)  # @CHIEF_DIES
        if MODE == "shape":
            strategy.run(other_shape)
    if MODE == "slow" and rank == 1:
        time.sleep(SLOW_S)  # @SLOW
    try:
        loss = strategy.run(step, args=(torch.ones(4, 4), i))
    except ValueError:
        continue  # the loop skips the bad batch, on replica 1 only
    if MODE == "extra" and rank == 1 and i == 5:
        strategy.reduce("SUM", loss, axis=None)  # @EXTRA
    strategy.reduce("SUM", loss, axis=None)  # @REDUCE
    if not (MODE == "missing" and rank == 1 and i == 5):
        strategy.gather(loss, axis=0)  # @GATHER
    (OUT / f"step_{rank}").write_text(str(i))
print(f"done {rank}", flush=True)
