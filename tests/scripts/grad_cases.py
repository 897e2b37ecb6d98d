"""Programs that train on one device and must train the same under a strategy (issue 50).

Usage: python grad_cases.py OUT_DIR STRATEGY
STRATEGY: reference (plain torch on one device) or a configuration of tests/strategies.py.

Cases, each a fresh model and strategy on the same processes:

* ``sparse``: ``nn.Embedding(sparse=True)`` trained by ``SparseAdam`` beside a dense head (SGD with
  momentum); at some steps one replica's half of the batch uses token ids the other's never does.
* ``lazy``: a ``nn.LazyLinear`` built in ``scope()`` and materialised by its first forward inside ``run``.
* ``thaw``: a layer created frozen and thawed (``requires_grad_(True)``) inside the step function at step 5.

Each process writes ``OUT_DIR/CASE/params_<rank>.pt`` (the final parameters) or, where the strategy
refuses the case, ``OUT_DIR/CASE/error_<rank>.txt`` (the error's type and message).
"""

import contextlib
import faulthandler
import signal
import sys
from pathlib import Path

import torch

if __name__ == "__main__":  # a hung job dumps its stacks (the test harness sends SIGUSR1)
    faulthandler.register(signal.SIGUSR1, all_threads=True)
_TESTS = str(Path(__file__).resolve().parents[1])
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)

import phalanx as px  # noqa: E402

import strategies  # noqa: E402

GLOBAL_BATCH, STEPS = 8, 10
CASES = ("sparse", "lazy", "thaw")


def data(case):
    g = torch.Generator().manual_seed(1)
    out = []
    for step in range(STEPS):
        if case == "sparse":
            ids = torch.randint(0, 50, (GLOBAL_BATCH, 3), generator=g)
            if step % 3 == 1:  # the first half only ids below 25, the second only 25 and up
                ids[: GLOBAL_BATCH // 2] %= 25
                ids[GLOBAL_BATCH // 2 :] = ids[GLOBAL_BATCH // 2 :] % 25 + 25
            out.append((ids, torch.randn(GLOBAL_BATCH, 1, generator=g)))
        else:
            out.append((torch.randn(GLOBAL_BATCH, 5, generator=g), torch.randn(GLOBAL_BATCH, 1, generator=g)))
    return out


def build(case):
    torch.manual_seed(0)
    if case == "sparse":
        model = torch.nn.ModuleDict({"emb": torch.nn.Embedding(50, 4, sparse=True), "head": torch.nn.Linear(4, 1)})
        optimizers = [
            torch.optim.SparseAdam(list(model["emb"].parameters()), lr=0.05),
            torch.optim.SGD(model["head"].parameters(), lr=0.1, momentum=0.9),
        ]
        return model, optimizers
    if case == "lazy":
        model = torch.nn.Sequential(torch.nn.LazyLinear(8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    else:
        model = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
        for p in model[2].parameters():
            p.requires_grad_(False)
    return model, [torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)]


def per_example(case, model, x, y):
    out = model["head"](model["emb"](x).mean(1)) if case == "sparse" else model(x)
    return ((out - y) ** 2).squeeze(1)


def train(case, strategy):
    with strategy.scope() if strategy is not None else contextlib.nullcontext():
        model, optimizers = build(case)

    def step(i, x, y):
        if case == "thaw" and i == 5:
            for p in model[2].parameters():
                p.requires_grad_(True)  # inside the step, before its backward
        for opt in optimizers:
            opt.zero_grad()
        loss = per_example(case, model, x, y).sum() / GLOBAL_BATCH
        if strategy is not None:
            px.nn.mark_loss_scaled()
        loss.backward()
        for opt in optimizers:
            opt.step()

    n = strategy.num_replicas_in_sync if strategy is not None else 1
    rank = strategy.extended.replica_id if strategy is not None else 0
    per = GLOBAL_BATCH // n
    for i, (x, y) in enumerate(data(case)):
        if strategy is None:
            step(i, x, y)
        else:
            strategy.run(step, args=(i, x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]))
    return model


def main() -> None:
    out, name = Path(sys.argv[1]), sys.argv[2]
    for case in CASES:
        strategy = None if name == "reference" else strategies.make(name)
        rank = strategy.extended.replica_id if strategy is not None else 0
        folder = out / case
        folder.mkdir(parents=True, exist_ok=True)
        try:
            model = train(case, strategy)
        except px.errors.PhalanxError as e:
            (folder / f"error_{rank}.txt").write_text(f"{type(e).__name__}: {e}")
        else:
            torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, folder / f"params_{rank}.pt")
        if strategy is not None:
            strategy.close()


if __name__ == "__main__":
    main()
