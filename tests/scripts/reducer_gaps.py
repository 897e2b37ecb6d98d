"""Programs that train on one device but not under MirroredStrategy(["cpu:0", "cpu:1"]) (issue 50).

Usage: python reducer_gaps.py OUT_DIR SCENARIO [STRATEGY]   (STRATEGY: a tests/strategies.py name, default
mirrored_cpu_2; "reference" trains on one device, in this process)

Scenarios (each trains ``STEPS`` steps on the same global batches; :func:`train` is shared with the
tests, which run the reference in their own process):

- ``sparse``: ``nn.Embedding(sparse=True)`` with ``SparseAdam`` (sparse gradients);
- ``lazy``: ``nn.LazyLinear`` built in the scope, materialised by the first forward inside ``run``;
- ``thaw``: a frozen layer thawed (``requires_grad_(True)``) inside the step function at step 3.

Each process writes ``OUT_DIR/<scenario>_<rank>.json``: ``{"params": {...}}`` after training, or
``{"error": "<type>: <message>", "where": "<innermost phalanx frame>", "step": n}``.
"""

import contextlib
import faulthandler
import json
import signal
import sys
import traceback
from pathlib import Path

import torch

if __name__ == "__main__":  # a hung job dumps its stacks (the test harness sends SIGUSR1)
    faulthandler.register(signal.SIGUSR1, all_threads=True)
_TESTS = str(Path(__file__).resolve().parents[1])
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)

import phalanx as px  # noqa: E402

GLOBAL_BATCH, STEPS, THAW_AT = 8, 6, 3


def batches(scenario: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    out = []
    for _ in range(STEPS):
        x = (
            torch.randint(0, 10, (GLOBAL_BATCH,), generator=g)
            if scenario == "sparse"
            else torch.randn(GLOBAL_BATCH, 5, generator=g)
        )
        out.append((x, torch.randn(GLOBAL_BATCH, 4, generator=g)))
    return out


def build(scenario: str) -> tuple[torch.nn.Module, torch.optim.Optimizer | None]:
    torch.manual_seed(0)
    if scenario == "sparse":
        model = torch.nn.Embedding(10, 4, sparse=True)
        return model, torch.optim.SparseAdam(list(model.parameters()), lr=0.1)
    if scenario == "lazy":
        return torch.nn.Sequential(torch.nn.LazyLinear(4)), None  # the optimizer: after materialising
    model = torch.nn.Sequential(torch.nn.Linear(5, 6), torch.nn.Tanh(), torch.nn.Linear(6, 4))
    model[0].requires_grad_(False)  # frozen until THAW_AT
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def train(strategy, scenario: str) -> dict[str, list]:
    with strategy.scope() if strategy is not None else contextlib.nullcontext():
        model, optimizer = build(scenario)
    n = 1 if strategy is None else strategy.num_replicas_in_sync
    rank = 0 if strategy is None else strategy.extended.replica_id
    state = {"optimizer": optimizer}

    def step_fn(x, y, step):
        if scenario == "thaw" and step == THAW_AT:
            model[0].requires_grad_(True)  # thawed inside the step
        out = model(x)
        if state["optimizer"] is None:  # LazyLinear materialised by this first forward
            state["optimizer"] = torch.optim.SGD(model.parameters(), lr=0.1)
        loss = px.nn.compute_average_loss(((out - y) ** 2).sum(-1), global_batch_size=GLOBAL_BATCH)
        state["optimizer"].zero_grad()
        loss.backward()
        state["optimizer"].step()

    per = GLOBAL_BATCH // n
    for step, (x, y) in enumerate(batches(scenario)):
        if strategy is None:
            step_fn(x, y, step)
        else:
            strategy.run(step_fn, args=(x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per], step))
    return {k: v.detach().tolist() for k, v in model.state_dict().items()}


def main() -> None:
    out, scenario = Path(sys.argv[1]), sys.argv[2]
    name = sys.argv[3] if len(sys.argv) > 3 else "mirrored_cpu_2"
    import strategies

    strategy = strategies.make(name)
    rank = strategy.extended.process_index
    try:
        record = {"params": train(strategy, scenario)}
    except Exception as e:  # noqa: BLE001 - the finding is recorded for the test
        frames = [f for f in traceback.extract_tb(e.__traceback__) if "/phalanx/" in f.filename]
        where = f"{frames[-1].filename.split('/src/')[-1]}:{frames[-1].lineno} ({frames[-1].name})" if frames else ""
        record = {"error": f"{type(e).__name__}: {str(e)[:400]}", "where": where, "step": strategy.extended.step}
    (out / f"{scenario}_{rank}.json").write_text(json.dumps(record))
    with contextlib.suppress(Exception):
        strategy.close()


if __name__ == "__main__":
    main()
