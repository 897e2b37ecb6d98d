"""Parameters that a step does not use, under a strategy and on one device.

Usage: python unused_params.py OUT_DIR STRATEGY[,STRATEGY...] [OPTIMIZER ...]
STRATEGY: reference (plain torch on one device) or a configuration of tests/strategies.py.

A small mixture of experts with an auxiliary head: every example goes through a shared trunk and
then through ``expert_a`` or ``expert_b`` (chosen by the sign of its first feature); the auxiliary
head joins the loss on even steps only. The data is built so that, over the steps:

- at some steps no example of the *global* batch goes to ``expert_b`` (unused everywhere);
- at others the first half of the batch (replica 0's slice on two replicas) goes to ``expert_a`` only
  and the second half to ``expert_b`` only (each expert used on one replica);
- the auxiliary head is unused on odd steps, on every replica.

One device leaves a parameter without a gradient alone (``.grad`` stays None after
``zero_grad()``, so SGD's momentum and AdamW's weight decay skip it). Each process writes
``OUT_DIR/STRATEGY,OPTIMIZER/params_<rank>.pt`` with the final parameters and ``grads_<rank>.json``
with, per step, which parameters had ``.grad is None`` after backward.
"""

import contextlib
import faulthandler
import json
import sys
from pathlib import Path

import torch

if __name__ == "__main__":  # a hung job dumps its stacks (on the signal the test harness sends)
    from phalanx.config import stack_signal  # PHALANX_STACK_SIGNAL, as the test harness sends

    faulthandler.register(stack_signal(), all_threads=True)
_TESTS = str(Path(__file__).resolve().parents[1])
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)

import phalanx as px  # noqa: E402

import strategies  # noqa: E402

GLOBAL_BATCH, FEATURES, STEPS = 12, 6, 12
OPTIMIZERS = ("sgd_momentum", "adam", "adamw")


class Experts(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.trunk = torch.nn.Linear(FEATURES, 16)
        self.expert_a = torch.nn.Linear(16, 1)
        self.expert_b = torch.nn.Linear(16, 1)
        self.aux = torch.nn.Linear(16, 1)

    def forward(self, x: torch.Tensor, use_aux: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        h = torch.tanh(self.trunk(x))
        to_a = x[:, 0] > 0
        out = torch.zeros(x.shape[0], 1)
        if bool(to_a.any()):
            out = out.index_put((to_a.nonzero()[:, 0],), self.expert_a(h[to_a]))
        if bool((~to_a).any()):
            out = out.index_put(((~to_a).nonzero()[:, 0],), self.expert_b(h[~to_a]))
        return out, (self.aux(h) if use_aux else None)


def data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    batches = []
    for step in range(STEPS):
        x = torch.randn(GLOBAL_BATCH, FEATURES, generator=g)
        kind = step % 3
        if kind == 0:  # every example to expert_a: expert_b unused on every replica
            x[:, 0] = x[:, 0].abs() + 0.1
        elif kind == 1:  # first half to expert_a, second half to expert_b: each used on one replica
            half = GLOBAL_BATCH // 2
            x[:half, 0] = x[:half, 0].abs() + 0.1
            x[half:, 0] = -x[half:, 0].abs() - 0.1
        y = torch.randn(GLOBAL_BATCH, 1, generator=g)
        batches.append((x, y))
    return batches


def make_optimizer(name: str, params) -> torch.optim.Optimizer:
    if name == "sgd_momentum":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    if name == "adam":
        return torch.optim.Adam(params, lr=0.05)
    return torch.optim.AdamW(params, lr=0.05, weight_decay=0.5)


def loss_of(model: Experts, x: torch.Tensor, y: torch.Tensor, step: int) -> torch.Tensor:
    out, aux = model(x, use_aux=step % 2 == 0)
    per_example = (out - y).pow(2).squeeze(1)
    if aux is not None:
        per_example = per_example + 0.5 * aux.pow(2).squeeze(1)
    return px.nn.compute_average_loss(per_example, global_batch_size=GLOBAL_BATCH)


def none_grads(model: Experts) -> list[str]:
    return sorted(name for name, p in model.named_parameters() if p.grad is None)


def train(strategy, opt_name: str) -> tuple[Experts, list[list[str]]]:
    torch.manual_seed(0)
    with strategy.scope() if strategy is not None else contextlib.nullcontext():
        model = Experts()
        optimizer = make_optimizer(opt_name, model.parameters())
    seen: list[list[str]] = []

    def step_fn(x: torch.Tensor, y: torch.Tensor, step: int) -> torch.Tensor:
        optimizer.zero_grad()
        loss = loss_of(model, x, y, step)
        loss.backward()
        seen.append(none_grads(model))
        optimizer.step()
        return loss

    for step, (x, y) in enumerate(data()):
        if strategy is None:
            step_fn(x, y, step)
            continue
        n, rank = strategy.num_replicas_in_sync, strategy.extended.replica_id
        per = GLOBAL_BATCH // n
        strategy.run(step_fn, args=(x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per], step))
    return model, seen


def main() -> None:
    out = Path(sys.argv[1])
    names = sys.argv[2].split(",")
    optimizers = sys.argv[3:] or list(OPTIMIZERS)
    for name in names:
        for opt_name in optimizers:
            strategy = None if name == "reference" else strategies.make(name)
            model, seen = train(strategy, opt_name)
            rank = 0 if strategy is None else strategy.extended.replica_id
            folder = out / f"{name},{opt_name}"
            folder.mkdir(parents=True, exist_ok=True)
            # A sharded model's parameters are DTensors: gathered whole (a collective, on every rank).
            state = {
                k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
                for k, v in model.state_dict().items()
            }
            torch.save(state, folder / f"params_{rank}.pt")
            (folder / f"grads_{rank}.json").write_text(json.dumps(seen))
            if strategy is not None:
                strategy.close()


if __name__ == "__main__":
    main()
