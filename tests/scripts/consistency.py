"""Replicas that must not drift apart (issue 13), as a user's custom loop meets them.

Usage:
    python consistency.py accumulate OUT N CASE [CASE ...]        (CASE: KIND,OPT,MICRO,MODE; KIND:
                                                                   mirrored | central | mwms; MODE:
                                                                   plain | no_sync | thaw)
    python consistency.py diverge CASE KIND N [noreduce]         (CASE: skip | outside_scope | batch_size |
                                                                   restore)
    python consistency.py diverge-many N CASE,KIND,REDUCE [...]  (REDUCE: reduce | noreduce)

``accumulate`` saves each replica's parameters after STEPS optimizer steps of MICRO micro-batches
each (gradients accumulated without zero_grad), to ``OUT/CASE/params_<rank>.pt``. The cases run one
after the other on the same N processes (a fresh strategy, model and optimizer each: process
start-up is most of what a case costs); the one-device references come from :func:`references`,
which the test calls in its own process. In ``thaw`` mode the first layer is created frozen
and unfrozen from the second step on, and the last layer frozen for the third step (fine-tuning's
usual moves), as :func:`trainable`. ``diverge`` prints, on each replica that catches
it, ``DIVERGED <rank> <wall time of the catch> <wall time the divergence began> <error>`` and
re-raises. With ``noreduce`` the loop calls no ``strategy.reduce``: only the gradient collectives
can catch the divergence. ``diverge-many`` runs several cases one after the other on the same N
processes (a fresh strategy each; a case that diverged closes its strategy, and the next starts
anew), labels every line with ``CASE,KIND,REDUCE``, prints ``CASE <label> done <rank>`` after a case
that ends normally, and at the end re-raises the first divergence: the job fails as one that
stopped at it would.
"""

import contextlib
import faulthandler
import json
import os
import sys
import time

import torch

if __name__ == "__main__":  # a replica process; not the test process that imports references()
    from phalanx.config import stack_signal  # PHALANX_STACK_SIGNAL, as the test harness sends

    faulthandler.register(stack_signal(), all_threads=True)

import phalanx as px
from phalanx.errors import ReplicaDivergenceError

STEPS, GLOBAL, FEATURES = 3, 24, 10


def make_model():
    return torch.nn.Sequential(torch.nn.Linear(FEATURES, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def make_optimizer(name, params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9) if name == "sgd" else torch.optim.Adam(params, lr=0.01)


def micro_batches(micro, size=GLOBAL):
    g = torch.Generator().manual_seed(7)
    n = STEPS * micro
    x = torch.randn(n * size, FEATURES, generator=g)
    y = torch.sin(x.sum(1, keepdim=True))
    return [(x[i : i + size], y[i : i + size]) for i in range(0, len(x), size)]


def trainable(model, step):
    """The thaw schedule: layer 0 frozen at step 0, layer 2 frozen at step 2, the rest trainable."""
    for p in model[0].parameters():
        p.requires_grad_(step >= 1)
    for p in model[2].parameters():
        p.requires_grad_(step < 2)


def make_strategy(kind, n):
    if kind == "central":
        return px.CentralStorageStrategy([f"cpu:{i}" for i in range(n)])
    if kind == "mwms":
        return px.MultiWorkerMirroredStrategy()
    return px.MirroredStrategy([f"cpu:{i}" for i in range(n)])


def references():
    """Plain PyTorch on one device: {(opt, micro): params} and {(opt, micro, "thaw"): params}."""
    found = {}
    for name in ("sgd", "adam"):
        for k in (2, 4):
            torch.manual_seed(0)
            model = make_model()
            opt = make_optimizer(name, model.parameters())
            for i, (x, y) in enumerate(micro_batches(k)):
                (((model(x) - y) ** 2).sum() / (GLOBAL * k)).backward()
                if (i + 1) % k == 0:
                    opt.step()
                    opt.zero_grad()
            found[name, k] = {key: v.detach().clone() for key, v in model.state_dict().items()}
    for name, k in (("sgd", 2),):  # the thaw cases' schedule
        torch.manual_seed(0)
        model = make_model()
        trainable(model, 0)
        opt = make_optimizer(name, model.parameters())
        for i, (x, y) in enumerate(micro_batches(k)):
            trainable(model, i // k)
            (((model(x) - y) ** 2).sum() / (GLOBAL * k)).backward()
            if (i + 1) % k == 0:
                opt.step()
                opt.zero_grad()
        found[name, k, "thaw"] = {key: v.detach().clone() for key, v in model.state_dict().items()}
    return found


def accumulate_cases(out, n, cases):
    for case in cases:
        kind, opt_name, micro, mode = case.split(",")
        print(f"CASE {case} begins", flush=True)  # a failing case is named in the job's log
        folder = os.path.join(out, case)
        os.makedirs(folder, exist_ok=True)
        accumulate(folder, opt_name, kind, n, int(micro), mode)


def accumulate(out, opt_name, kind, n, micro, mode):
    data = micro_batches(micro)
    strategy = make_strategy(kind, n)
    rank = strategy.extended.process_index
    torch.manual_seed(0 if rank == 0 else 99)  # the scope's broadcast must make them equal
    with strategy.scope():
        model = make_model()
        if mode == "thaw":
            trainable(model, 0)
        opt = make_optimizer(opt_name, model.parameters())

    def forward_backward(x, y, last):
        per_example = ((model(x) - y) ** 2).sum(dim=1)
        # Each micro-batch's loss is divided by the whole step's global batch: GLOBAL * micro.
        px.nn.compute_average_loss(per_example, global_batch_size=GLOBAL * micro).backward()
        if last:
            opt.step()
            opt.zero_grad()

    for i, (x, y) in enumerate(strategy.experimental_distribute_dataset(data)):
        last = (i + 1) % micro == 0
        if mode == "thaw":
            trainable(model, i // micro)
        with strategy.extended.no_sync() if mode == "no_sync" and not last else contextlib.nullcontext():
            strategy.run(forward_backward, args=(x, y, last))
    torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, os.path.join(out, f"params_{rank}.pt"))
    strategy.close()


def diverge(case, kind, n, use_reduce=True, label=None, keep_going=False):
    """One divergence case; returns its ReplicaDivergenceError when ``keep_going``, else raises it."""
    label = label or case
    strategy = make_strategy(kind, n)
    rank = strategy.extended.process_index
    torch.manual_seed(rank)
    if case == "outside_scope":
        model = make_model()  # the user's mistake: every replica has its own random weights
    with strategy.scope():
        if case != "outside_scope":
            model = make_model()
        opt = make_optimizer("sgd", model.parameters())
    size = GLOBAL * (rank + 1) if case == "batch_size" else GLOBAL  # each process built its own loader
    data = micro_batches(4, size)
    began = None
    try:
        for i, (x, y) in enumerate(strategy.experimental_distribute_dataset(data)):
            if began is None and (case != "skip" and case != "restore" or i == 2):
                began = time.time()
            if case == "restore" and i == 2:
                with torch.no_grad():  # a restore that gave replica 1 other values
                    if rank == 1:
                        model[2].bias.add_(1.0)
                strategy.extended.mark_parameters_changed()

            def step(x, y, i=i):
                if case == "skip" and rank == 1 and i == 2:
                    raise ValueError("a bad record on replica 1 only")
                loss = px.nn.compute_average_loss(((model(x) - y) ** 2).sum(dim=1))
                opt.zero_grad()
                loss.backward()
                opt.step()
                return loss

            try:
                result = strategy.run(step, args=(x, y))
                if use_reduce:
                    strategy.reduce("SUM", result, axis=None)
            except ValueError:
                continue  # the user's loop skips the bad batch (on replica 1 only)
    except ReplicaDivergenceError as e:
        print(f"DIVERGED {label} {rank} {time.time():.3f} {began:.3f} {type(e).__name__}: {e}", flush=True)
        # Replica 0's error stops the job at once: on a loaded machine that can come before a peer
        # that caught it too has printed its line. Wait (bounded) until every replica has.
        open(f"caught_{label}_{rank}", "w").close()
        deadline = time.monotonic() + 2.0
        while (
            rank == 0
            and time.monotonic() < deadline
            and not all(os.path.exists(f"caught_{label}_{r}") for r in range(n))
        ):
            time.sleep(0.01)
        if not keep_going:
            raise
        strategy.close()
        return e
    digest = sum(float(p.double().sum()) for p in model.parameters())
    print(f"NOT DIVERGED {label} {rank} {digest!r}", flush=True)
    if kind == "central":
        count_collectives(strategy, model, opt, data, label)
    strategy.close()
    print(f"CASE {label} done {rank}", flush=True)
    return None


def diverge_many(n, cases):
    errors = []
    for label in cases:
        case, kind, reduce_ = label.split(",")
        print(f"CASE {label} begins", flush=True)
        error = diverge(case, kind, n, use_reduce=reduce_ == "reduce", label=label, keep_going=True)
        if error is not None:
            errors.append(error)
    # Replica 0's error stops the others at once: wait (bounded) until every replica has printed
    # all its lines.
    open(f"finished_{os.getpid()}", "w").close()
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline and len([f for f in os.listdir(".") if f.startswith("finished_")]) < n:
        time.sleep(0.01)
    if errors:
        raise errors[0]


def count_collectives(strategy, model, opt, data, label):
    """Prints ``COLLECTIVES <label> <rank> <json>``: the collectives of one training step, guard on and off."""
    comm = strategy.extended.communicator
    calls = {"all_reduce": 0, "reduce": 0}

    def counted(name):
        method = getattr(comm, name)

        def call(*args, **kwargs):
            calls[name] += 1
            return method(*args, **kwargs)

        return call

    comm.all_reduce, comm.reduce = counted("all_reduce"), counted("reduce")  # this instance only

    def step(x, y):
        opt.zero_grad()
        px.nn.compute_average_loss(((model(x) - y) ** 2).sum(dim=1)).backward()
        opt.step()

    per_step = {}
    x, y = next(iter(strategy.experimental_distribute_dataset(data[:1])))
    for on in (True, False):
        strategy.extended.set_consistency_checks(on)
        strategy.run(step, args=(x, y))  # a step after the switch; the next is counted
        before = dict(calls)
        strategy.run(step, args=(x, y))
        per_step["on" if on else "off"] = {k: calls[k] - before[k] for k in calls}
    print(f"COLLECTIVES {label} {strategy.extended.process_index} {json.dumps(per_step)}", flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "accumulate":
        accumulate_cases(sys.argv[2], int(sys.argv[3]), sys.argv[4:])
    elif sys.argv[1] == "diverge-many":
        diverge_many(int(sys.argv[2]), sys.argv[3:])
    else:
        case, kind, n = sys.argv[2:5]
        diverge(case, kind, int(n), use_reduce=sys.argv[5:6] != ["noreduce"])
