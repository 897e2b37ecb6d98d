"""Training under FullyShardedStrategy against one device, Mirrored and plain PyTorch (issue 32).

Usage: python sharded.py OUT_DIR N VARIANT [VARIANT ...]
       torchrun --nproc-per-node N sharded.py OUT_DIR env {sharded,mwms} [init]
       TF_CONFIG=... python sharded.py OUT_DIR env sharded       (one per worker)

Each VARIANT trains a fresh model with a fresh strategy on the same N processes (one job, many
variants: start-up is most of a run's cost); the chief writes OUT_DIR/VARIANT/params.pt (whole
tensors) and every replica OUT_DIR/VARIANT/memory_<rank>.json.

VARIANT is ``STRATEGY,OPTIMIZER[,FEATURE...]``:

* STRATEGY: ``sharded`` (FullyShardedStrategy, each Linear sharded on its own), ``sharded_root``
  (one group per model: the default threshold), ``mirrored``.
* OPTIMIZER: ``sgd`` (momentum), ``adam``, ``adamw``.
* FEATURE: ``clip`` (clip_grad_norm_ to 0.5), ``accum`` (two micro-batches a step, the first under
  ``no_sync``), ``bf16`` (autocast to bfloat16), ``compiled`` (torch.compile of the model), ``variable`` (a trainable ``phalanx.Variable``
  on no module scales the output: it stays whole, its gradient all-reduced), ``function`` (the
  step's replica function under
  ``@phalanx.function``, inductor),
  ``save`` (after STEPS_BEFORE_SAVE steps, a Checkpoint is written to OUT_DIR/VARIANT/ckpt, and
  every replica writes OUT_DIR/VARIANT/save_memory_<rank>.json: the peak bytes of tensors the save
  allocated, and the bytes of the state it holds), ``wide`` (a model of 512-wide hidden layers, 1 MiB
  of parameters: its tensors outweigh the bookkeeping of a save),
  ``restore=PATH`` (last; the model and optimizer are restored from PATH before training, and only
  the steps after STEPS_BEFORE_SAVE are taken), ``loose`` (a parameter on no module, stepped by
  the optimizer: refused), ``inrun`` (a module first built inside run: refused), ``outofstep``
  (replica 1 runs one (empty) step more: the guard names it at the next forward), ``crash``
  (replica 1 raises after its first step: the job fails). A refusal (a
  PhalanxError) is written to OUT_DIR/VARIANT/error_<rank>.txt.

The second form trains ``sharded,adam`` (or ``mwms,adam``) with the strategy built from the
launcher's environment (``init``: the program makes torch's default process group first).

The test imports :func:`reference` (plain PyTorch on one device) and compares.
"""

import faulthandler
import json
import os
import sys
from pathlib import Path

import torch

if __name__ == "__main__":  # a hung job dumps its stacks (on the signal the test harness sends)
    from phalanx.config import stack_signal  # PHALANX_STACK_SIGNAL, as the test harness sends

    faulthandler.register(stack_signal(), all_threads=True)

_ROOT = str(Path(__file__).resolve().parents[2])  # the repository: the benchmark's byte count
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

import phalanx as px  # noqa: E402
from benchmarks.sharded import local_bytes  # noqa: E402 - the one definition of the measure
from phalanx.checkpoint import Checkpoint  # noqa: E402

STEPS, STEPS_BEFORE_SAVE, GLOBAL_BATCH, FEATURES = 8, 4, 24, 12


def make_model(wide=False):
    hidden = (512, 512) if wide else (40, 24)  # wide: tensors large against DCP's bookkeeping (a save's)
    return torch.nn.Sequential(
        torch.nn.Linear(FEATURES, hidden[0]),
        torch.nn.Tanh(),
        torch.nn.Linear(*hidden),
        torch.nn.Tanh(),
        torch.nn.Linear(hidden[1], 3),
    )


def make_optimizer(name, params):
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=0.01, weight_decay=0.1)
    return torch.optim.Adam(params, lr=0.01)


def data():
    g = torch.Generator().manual_seed(4321)
    x = torch.randn(STEPS * GLOBAL_BATCH, FEATURES, generator=g)
    y = torch.cat([torch.sin(x[:, :3]), torch.cos(x[:, 3:6].sum(1, keepdim=True)), x[:, 6:8]], dim=1)[:, :3]
    return [(x[i : i + GLOBAL_BATCH], y[i : i + GLOBAL_BATCH]) for i in range(0, len(x), GLOBAL_BATCH)]


def _autocast(features):
    return torch.autocast("cpu", dtype=torch.bfloat16) if "bf16" in features else torch.autocast("cpu", enabled=False)


def _per_example(model, x, y, features):
    with _autocast(features):
        out = model(x)
    return ((out.float() - y) ** 2).mean(dim=1)


def _clip(model, features):
    if "clip" in features:
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)


def reference(opt_name, features=(), steps=range(STEPS)):
    """Plain PyTorch on one device, the whole global batch per step."""
    torch.manual_seed(0)
    model = make_model()
    extra = [torch.nn.Parameter(torch.ones(3))] if "variable" in features else []
    opt = make_optimizer(opt_name, [*model.parameters(), *extra])
    if extra:
        net = model
        model = lambda x: net(x) * extra[0]  # noqa: E731
        model.state_dict = net.state_dict
    batches = data()
    for i in steps:
        x, y = batches[i]
        if "accum" in features:  # the same two micro-batches, summed
            for part in (slice(0, GLOBAL_BATCH // 2), slice(GLOBAL_BATCH // 2, None)):
                (_per_example(model, x[part], y[part], features).sum() / GLOBAL_BATCH).backward()
        else:
            (_per_example(model, x, y, features).sum() / GLOBAL_BATCH).backward()
        _clip(model, features)
        opt.step()
        opt.zero_grad()
    return model


def make_strategy(kind, n):
    cpus = [f"cpu:{i}" for i in range(n)]
    if kind == "sharded":
        return px.FullyShardedStrategy(cpus, min_params_to_shard=64)
    if kind == "sharded_root":
        return px.FullyShardedStrategy(cpus)
    if kind == "mirrored":
        return px.MirroredStrategy(cpus)
    raise ValueError(f"unknown strategy {kind!r}")


def train(strategy, opt_name, features, out):
    torch.manual_seed(0 if strategy.extended.should_checkpoint else 99)  # the broadcast makes them equal
    with strategy.scope():
        model = make_model("wide" in features)
        if "loose" in features:
            free = torch.nn.Parameter(torch.zeros(3))  # on no module: no registration announces it
        # A variable on no module (TF's tf.Variable): whole on every replica, gradient all-reduced.
        scale = px.Variable(torch.ones(3)) if "variable" in features else None
        extra = [free] if "loose" in features else [scale] if scale is not None else []
        opt = make_optimizer(opt_name, [*model.parameters(), *extra])
    if "loose" in features:

        def loose_step():
            (free.sum() + sum(p.sum() for p in model.parameters())).backward()
            opt.step()

        strategy.run(loose_step)
        raise AssertionError(f"a free parameter {free.shape} was accepted")
    if "inrun" in features:
        strategy.run(lambda: torch.nn.Linear(2, 2))
        raise AssertionError("a module built inside run was accepted")
    forward = torch.compile(model) if "compiled" in features else model
    if scale is not None:
        net = forward
        forward = lambda x: net(x) * scale  # noqa: E731
    restore = next((f.split("=", 1)[1] for f in features if f.startswith("restore=")), None)
    first = 0
    if restore is not None:
        Checkpoint(model=model, optimizer=opt).restore(restore)
        first = STEPS_BEFORE_SAVE

    def forward_backward(x, y):
        loss = px.nn.compute_average_loss(_per_example(forward, x, y, features), global_batch_size=GLOBAL_BATCH)
        loss.backward()
        return loss

    def update():
        _clip(model, features)
        opt.step()
        opt.zero_grad()

    if "function" in features:  # the replica functions compiled, as under tf.function
        run_compiled = px.function(lambda fn, *a: strategy.run(fn, args=a))
    else:
        run_compiled = None
    batches = data()
    for i in range(first, STEPS):
        x, y = batches[i]
        if "accum" in features:
            halves = [
                (x[: GLOBAL_BATCH // 2], y[: GLOBAL_BATCH // 2]),
                (x[GLOBAL_BATCH // 2 :], y[GLOBAL_BATCH // 2 :]),
            ]
            for k, (hx, hy) in enumerate(strategy.experimental_distribute_dataset(halves)):
                with strategy.extended.no_sync() if k == 0 else _nothing():
                    strategy.run(forward_backward, args=(hx, hy))
        else:
            for bx, by in strategy.experimental_distribute_dataset([(x, y)]):
                if run_compiled is not None:
                    run_compiled(forward_backward, bx, by)
                else:
                    strategy.run(forward_backward, args=(bx, by))
                if "outofstep" in features and i == 2 and strategy.extended.process_index == 1:
                    strategy.run(lambda: None)  # one replica runs a step more (a chief-only log step)
        memory = local_bytes(model, opt)  # gradients present: the step's peak of the three
        if "crash" in features and strategy.extended.process_index == 1:
            raise RuntimeError("boom on replica 1")  # uncaught: the job fails with this traceback
        strategy.run(update)
        if "save" in features and i + 1 == STEPS_BEFORE_SAVE:
            peak = peak_tensor_bytes(lambda: Checkpoint(model=model, optimizer=opt).write(os.path.join(out, "ckpt")))
            rank = strategy.extended.process_index
            Path(out, f"save_memory_{rank}.json").write_text(json.dumps({"peak": peak, **local_bytes(model, opt)}))
    rank = strategy.extended.process_index
    memory.update(local_bytes(model, opt), grads=memory["grads"])
    memory.pop("total")
    Path(out, f"memory_{rank}.json").write_text(json.dumps(memory))
    state = {}
    for k, v in model.state_dict().items():  # whole tensors (a collective for shards)
        state[k] = (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
    if rank == 0:
        torch.save(state, os.path.join(out, "params.pt"))


def peak_tensor_bytes(fn):
    """The most bytes of CPU tensors that ``fn`` held allocated at once, beyond what was held before.

    torch's profiler reports every allocation and free of its CPU allocator; an allocation made
    inside an operator is counted when the operator starts (a temporary freed within the same
    operator does not count). This is how a sharded save is checked not to gather whole tensors.
    """
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted(prof.events(), key=lambda e: e.time_range.start)
    held = peak = 0
    for e in events:  # self: an operator's allocations without those of the operators it calls
        held += e.self_cpu_memory_usage
        peak = max(peak, held)
    return peak


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def from_environment(out, kind, init):
    """Under a launcher (torchrun): the strategy finds the cluster in the environment."""
    if init:  # the program made torch's default group itself, as torchrun programs do
        torch.distributed.init_process_group("gloo")
    strategy = (
        px.FullyShardedStrategy(min_params_to_shard=64) if kind == "sharded" else px.MultiWorkerMirroredStrategy()
    )
    expected = int(os.environ.get("WORLD_SIZE", 2))  # torchrun's, or the two TF_CONFIG workers
    assert strategy.num_replicas_in_sync == expected, strategy.num_replicas_in_sync
    try:
        train(strategy, "adam", [], out)
    finally:
        strategy.close()
    assert torch.distributed.is_initialized() == init  # phalanx closed the group it made, kept the program's


def main():
    if sys.argv[2] == "env":
        return from_environment(sys.argv[1], sys.argv[3], "init" in sys.argv[4:])
    out, n = sys.argv[1], int(sys.argv[2])
    for variant in sys.argv[3:]:
        head, _, restore = variant.partition(",restore=")  # last: a path may hold commas
        kind, opt_name, *features = head.split(",")
        features += [f"restore={restore}"] if restore else []
        folder = os.path.join(out, head)
        os.makedirs(folder, exist_ok=True)
        strategy = make_strategy(kind, n)
        try:
            train(strategy, opt_name, features, folder)
        except px.errors.PhalanxError as e:
            Path(folder, f"error_{strategy.extended.process_index}.txt").write_text(f"{type(e).__name__}: {e}")
        finally:
            strategy.close()


if __name__ == "__main__":
    main()
