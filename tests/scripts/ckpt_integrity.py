"""A damaged newest checkpoint under MirroredStrategy on 2 real replica processes (issue 29).

Usage: python ckpt_integrity.py OUT_DIR   (starts its second replica itself)

Both replicas save two checkpoints (step 1, then step 2); replica 0 flips one bit of the newest
one's MANIFEST.json (the step counter, 2 -> 6); then each replica restores through a fresh
``CheckpointManager.restore_or_initialize()`` and through ``Checkpoint.restore(newest)``.
Writes OUT_DIR/integrity_<rank>.json: what was chosen and restored, and the warnings logged.
"""

import json
import logging
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("KERAS_BACKEND", "torch")
import torch  # noqa: E402

import phalanx as px  # noqa: E402
from phalanx.checkpoint import Checkpoint, CheckpointError, CheckpointManager, Counter, storage  # noqa: E402

out = Path(sys.argv[1])
strategy = px.MirroredStrategy(["cpu:0", "cpu:1"])
rank = strategy.extended.process_index
directory = out / "ckpts"
flipped = out / "flipped"


class Warnings(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


with strategy.scope():
    w, step = torch.zeros(4), Counter()
    manager = CheckpointManager(Checkpoint(w=w, step=step), str(directory), max_to_keep=3)
for _ in range(2):
    w += 1
    step.assign_add(1)
    manager.save()  # collective: both replicas return once it is on disk
older, newest = manager.checkpoints
if rank == 0:
    text = Path(newest, storage.MANIFEST).read_text()
    data = bytearray(text.encode())
    data[text.index('"value": 2', text.index('"step"')) + len('"value": ')] ^= 1 << 2  # step 2 -> 6
    Path(newest, storage.MANIFEST).write_bytes(bytes(data))
    flipped.write_text("done")
deadline = time.monotonic() + 60
while not flipped.exists():  # replica 1 restores only once the damage is on disk
    if time.monotonic() > deadline:
        raise TimeoutError("replica 0 never flipped the bit")
    time.sleep(0.05)

storage.forget_verified()  # as a restarted process would start
handler = Warnings()
logging.getLogger("phalanx.checkpoint").addHandler(handler)
with strategy.scope():
    w2, step2 = torch.full((4,), -1.0), Counter()
    live = Checkpoint(w=w2, step=step2)
chosen = CheckpointManager(live, str(directory), max_to_keep=3).restore_or_initialize()
try:
    Checkpoint(w=torch.zeros(4), step=Counter()).restore(newest)
    restore_error = None
except CheckpointError as e:
    restore_error = f"{type(e).__name__}: {e}"
result = {
    "older": older,
    "newest": newest,
    "chosen": chosen,
    "step": int(step2),
    "w": w2.tolist(),
    "warnings": handler.messages,
    "restore_error": restore_error,
}
(out / f"integrity_{rank}.json").write_text(json.dumps(result))
