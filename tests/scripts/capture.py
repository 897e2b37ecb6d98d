"""Every parameter created in ``scope()`` is captured, however it comes into being (issue 28).

Usage: python capture.py OUT_DIR   (MirroredStrategy x2; starts its second replica itself)

Each capture check builds a model one way (``copy.deepcopy``, ``nn.TransformerEncoder``, a clone
into a Parameter, meta-device init then ``to_empty``, ``load_state_dict(assign=True)``,
``torch.func.functional_call``), each replica from its own random seed, trains it 3 steps and
records every replica's parameters and their distance to the same training on one device (seed 0,
the whole global batch). A failure is recorded (type and text) and the script goes on. Then the
drift check: replica 1 trains with another learning rate and the periodic parameter fingerprint
(``PHALANX_FINGERPRINT_EVERY``, set small by the test) must stop both replicas. Its error is
recorded in OUT_DIR/drift_<rank>.json and raised again, so the job exits non-zero.
Writes OUT_DIR/capture_<rank>.json.
"""

import copy
import json
import os
import sys
import time
import traceback

import torch
from torch import nn

import phalanx as px
from phalanx.errors import ReplicaDivergenceError, UnsynchronizedParameterError

out = sys.argv[1]
strategy = px.MirroredStrategy(["cpu:0", "cpu:1"])
rank = strategy.extended.process_index
GLOBAL, STEPS, LR = 8, 3, 0.1
gen = torch.Generator().manual_seed(123)
SEQ = torch.randn(GLOBAL, 6, 8, generator=gen)  # sequences, for the Transformer
X = SEQ[:, 0]
Y = torch.randn(GLOBAL, 8, generator=gen)
res = {}


def check(name):
    def deco(fn):
        try:
            res[name] = fn()
        except Exception as e:  # noqa: BLE001 - recorded for the test to assert on
            res[name] = {"error": type(e).__name__, "text": str(e)[:800], "tb": traceback.format_exc()[-2000:]}
        return fn

    return deco


def loss_of(model, x, y, forward=None):
    pred = (forward or model)(x)
    return ((pred - y) ** 2).mean(dim=tuple(range(1, pred.dim())))


def reference(build, after=None, forward=None, x=X):
    """The same training on one device: seed 0, the whole global batch, no strategy."""
    torch.manual_seed(0)
    model = build()
    if after is not None:
        after(model)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for _ in range(STEPS):
        opt.zero_grad()
        loss_of(model, x, Y, forward and forward(model)).mean().backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def distributed(build, after=None, forward=None, x=X):
    """Built in scope from this replica's own seed (replica 0's is the reference's), trained 3 steps."""
    torch.manual_seed(rank)  # replicas start different: only the capture's broadcast makes them equal
    with strategy.scope():
        model = build()
    if after is not None:
        after(model)  # outside the scope: the model was created in it
    with strategy.scope():
        opt = torch.optim.SGD(model.parameters(), lr=LR)
    lo, hi = rank * GLOBAL // 2, (rank + 1) * GLOBAL // 2
    call = forward(model) if forward else None

    def step(x, y):
        opt.zero_grad()
        px.nn.compute_average_loss(loss_of(model, x, y, call), global_batch_size=GLOBAL).backward()
        opt.step()

    for _ in range(STEPS):
        strategy.run(step, args=(x[lo:hi], Y[lo:hi]))
    return model


def compare(build, after=None, forward=None, x=X):
    """This replica's parameters after training, both replicas' checksums, and the distance to one device."""
    model = distributed(build, after, forward, x)
    ref = reference(build, after, forward, x)
    mine = dict(model.named_parameters())
    flat = torch.cat([p.detach().double().reshape(-1) for p in mine.values()])
    everyone = strategy.gather(strategy.run(lambda: flat.reshape(1, -1)), axis=0)
    return {
        "names": sorted(mine),
        "replicas_equal": bool(torch.equal(everyone[0], everyone[1])),
        "max_diff_to_one_device": max(float((mine[k].detach() - ref[k]).abs().max()) for k in ref),
        "same_names_as_one_device": sorted(ref) == sorted(mine),
    }


@check("outside_scope_still_refused")
def _():
    # First: the first-run watcher checks the first step that calls modules.
    torch.manual_seed(rank)
    outside = nn.Linear(8, 8)  # created outside scope: different on every replica
    try:
        strategy.run(lambda x: outside(x).sum().backward(), args=(X[:1],))
    except UnsynchronizedParameterError as e:
        return {"error": type(e).__name__, "text": str(e), "parameter": e.parameter}
    return {"raised": False}


@check("outside_scope_seeded")
def _():
    # The README's program with its model moved out of scope: a seed makes it start equal everywhere.
    # A strategy of its own (on the same replicas): its first step is the one the watch checks.
    seeded = px.MirroredStrategy(["cpu:0", "cpu:1"])
    torch.manual_seed(0)
    outside = nn.Linear(8, 8)
    try:
        seeded.run(lambda x: outside(x).sum().backward(), args=(X[:1],))
    except UnsynchronizedParameterError as e:
        return {"error": type(e).__name__, "text": str(e), "parameter": e.parameter}
    finally:
        seeded.close()
    return {"raised": False}


@check("deepcopy_sequential")
def _():
    def build():
        base = nn.Linear(8, 8)
        return nn.Sequential(base, nn.Tanh(), copy.deepcopy(base))

    return compare(build)


@check("standalone_deepcopy")
def _():
    # A DQN's target network: a deep copy made in scope and never put in a module. The copy was
    # made before the scope's broadcast, so each replica's holds its own random values.
    torch.manual_seed(rank)
    with strategy.scope():
        online = nn.Linear(8, 8)
        target = copy.deepcopy(online)

    def step(x):
        loss = px.nn.compute_average_loss((online(x) - target(x)).pow(2).sum(1) + target(x).sum(1))
        loss.backward()

    strategy.run(step, args=(X[rank * 2 : rank * 2 + 2],))
    flat = torch.cat([target.weight.detach().reshape(-1), target.weight.grad.reshape(-1)])
    everyone = strategy.gather(strategy.run(lambda: flat.reshape(1, -1)), axis=0)
    return {"replicas_equal": bool(torch.equal(everyone[0], everyone[1]))}


@check("free_parameter_refused")
def _():
    # An nn.Parameter that belongs to no module (a learnable temperature) is not captured by scope();
    # its gradient would stay per replica. The optimizer's first step in run names it instead.
    with strategy.scope():
        temperature = nn.Parameter(torch.ones(()))
        opt = torch.optim.SGD([temperature], lr=0.1)

    def step(x):
        px.nn.compute_average_loss((x.sum(1) * temperature).reshape(-1)).backward()
        opt.step()

    try:
        strategy.run(step, args=(X[rank * 2 : rank * 2 + 2],))
    except UnsynchronizedParameterError as e:
        return {"error": type(e).__name__, "text": str(e)}
    return {"raised": False}


@check("free_variable_trains")
def _():
    # Its port, phalanx.Variable (TF's tf.Variable): captured, gradients summed, equal everywhere.
    with strategy.scope():
        temperature = px.Variable(1.0)
        opt = torch.optim.SGD([temperature], lr=0.1)

    def step(x):
        px.nn.compute_average_loss((x.sum(1) * temperature).reshape(-1), global_batch_size=4).backward()
        opt.step()

    strategy.run(step, args=(X[rank * 2 : rank * 2 + 2],))
    want = 1.0 - 0.1 * float(X[:4].sum()) / 4  # one device on the global batch of 4
    values = strategy.gather(strategy.run(lambda: temperature.detach().reshape(1)), axis=0)
    return {"values": values.tolist(), "one_device": want}


@check("transformer_encoder")
def _():
    def build():
        layer = nn.TransformerEncoderLayer(d_model=8, nhead=2, dim_feedforward=16, dropout=0.0, batch_first=True)
        encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        return nn.Sequential(encoder, nn.Flatten(), nn.Linear(6 * 8, 8))

    return compare(build, x=SEQ)


class Tied(nn.Module):
    """A layer whose second weight starts as a clone of the first (``nn.Parameter(w.clone())``)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)

    def forward(self, x):
        out = self.a(x)
        return out @ self.b.T if hasattr(self, "b") else out


def _clone_b(model):
    model.b = nn.Parameter(model.a.weight.detach().clone())


@check("clone_parameter_in_scope")
def _():
    def build():
        model = Tied()
        _clone_b(model)
        return model

    return compare(build)


@check("clone_parameter_after_scope")
def _():
    # The module was created in scope; a parameter it is given later belongs to the same model.
    return compare(Tied, after=_clone_b)


def _materialize(model):
    model.to_empty(device="cpu")
    for m in model.modules():
        if hasattr(m, "reset_parameters"):
            m.reset_parameters()


def _on_meta():
    with torch.device("meta"):
        return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))


@check("meta_to_empty_in_scope")
def _():
    def build():
        model = _on_meta()
        _materialize(model)
        return model

    return compare(build)


@check("meta_to_empty_after_scope")
def _():
    return compare(_on_meta, after=_materialize)


def _weights():
    # The same state on every replica (a pretrained checkpoint everyone loads).
    g = torch.Generator().manual_seed(7)
    return {
        "0.weight": torch.randn(16, 8, generator=g),
        "0.bias": torch.randn(16, generator=g),
        "2.weight": torch.randn(8, 16, generator=g),
        "2.bias": torch.randn(8, generator=g),
    }


def _mlp():
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))


def _assign(model):
    model.load_state_dict(_weights(), assign=True)


@check("load_state_dict_assign_in_scope")
def _():
    def build():
        model = _mlp()
        _assign(model)
        return model

    return compare(build)


@check("load_state_dict_assign_after_scope")
def _():
    return compare(_mlp, after=_assign)


@check("meta_then_assign_in_scope")
def _():
    def build():
        model = _on_meta()
        _assign(model)
        return model

    return compare(build)


@check("functional_call")
def _():
    def forward(model):
        return lambda x: torch.func.functional_call(model, dict(model.named_parameters()), (x,))

    return compare(_mlp, forward=forward)


with open(os.path.join(out, f"capture_{rank}.json"), "w") as f:
    json.dump(res, f)

# ---- drift: replica 1 trains with another learning rate; the periodic fingerprint stops both.
every = int(os.environ["PHALANX_FINGERPRINT_EVERY"])
torch.manual_seed(0)
with strategy.scope():
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01 if rank == 0 else 0.1)


def step(x, y):
    opt.zero_grad()
    px.nn.compute_average_loss(loss_of(model, x, y), global_batch_size=GLOBAL).backward()
    opt.step()


start = strategy.extended.step
drift = {"start": start, "every": every}
try:
    for _ in range(4 * every + 4):
        strategy.run(step, args=(X[rank * 4 : rank * 4 + 4], Y[rank * 4 : rank * 4 + 4]))
    drift["raised"] = False
except ReplicaDivergenceError as e:
    drift.update(
        raised=True,
        type=type(e).__name__,
        field=e.field,
        replicas=list(e.replicas),
        parameter=e.parameter,
        at=strategy.extended.step,
        text=str(e),
    )
    raise
finally:
    with open(os.path.join(out, f"drift_{rank}.tmp"), "w") as f:
        json.dump(drift, f)
    os.replace(os.path.join(out, f"drift_{rank}.tmp"), os.path.join(out, f"drift_{rank}.json"))  # whole or absent
    # The launcher ends the job soon after the first replica fails: let replica 1 record its error
    # first (on a loaded machine it may be scheduled late), within a bound.
    waited = 0.0
    while rank == 0 and waited < 60 and not os.path.exists(os.path.join(out, "drift_1.json")):
        time.sleep(0.05)
        waited += 0.05
