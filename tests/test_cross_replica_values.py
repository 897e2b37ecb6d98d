"""What the cross-replica APIs return is a value, alike on one replica and on several.

``strategy.reduce`` returned the loss still attached to the autograd graph on one replica and a
detached tensor on several, so the README's first program, switched to ``OneDeviceStrategy`` (a
one-line change), printed torch's "Converting a tensor with requires_grad=True to a scalar" warning
at ``float(strategy.reduce(...))``. TF's ``strategy.reduce`` returns a value too, outside the
replica's gradient tape.
"""

from __future__ import annotations

import json
import sys

import pytest

from conftest import run_job

# The README's first program (shortened), then what each cross-replica API returns. Warnings are
# errors: the first one fails the job with its message.
PROGRAM = """
import json, sys, warnings
import torch
import phalanx as px

kind = sys.argv[1]
strategy = {
    "one_device": lambda: px.OneDeviceStrategy("cpu"),
    "mirrored_1": lambda: px.MirroredStrategy(["cpu:0"]),
    "mirrored_2": lambda: px.MirroredStrategy(["cpu:0", "cpu:1"]),
}[kind]()
warnings.simplefilter("error")
GLOBAL_BATCH = 16
torch.manual_seed(0)
x = torch.randn(64, 20)
y = (x[:, :10].sum(dim=1) > 0).long()
loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=GLOBAL_BATCH)
with strategy.scope():
    model = torch.nn.Sequential(torch.nn.Linear(20, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)


def train_step(xb, yb):
    per_example = torch.nn.functional.cross_entropy(model(xb), yb, reduction="none")
    loss = px.nn.compute_average_loss(per_example, global_batch_size=GLOBAL_BATCH)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return loss, per_example


total = 0.0
for xb, yb in strategy.experimental_distribute_dataset(loader):
    loss, per_example = strategy.run(train_step, args=(xb, yb))
    total += float(strategy.reduce(px.ReduceOp.SUM, loss, axis=None))
results = {
    "reduce_sum": strategy.reduce("SUM", loss, axis=None),
    "reduce_mean": strategy.reduce("MEAN", loss, axis=None),
    "reduce_mean_axis": strategy.reduce("MEAN", per_example, axis=0),
    "reduce_nested": strategy.reduce("SUM", {"loss": loss}, axis=None)["loss"],
    "gather": strategy.gather(per_example, axis=0),
    "local_results": strategy.experimental_local_results(loss)[0],
}
record = {name: value.requires_grad for name, value in results.items()}
record["replicas"] = strategy.num_replicas_in_sync
if strategy.extended.process_index == 0:
    with open(f"{kind}.json", "w") as f:
        json.dump(record, f)
print(f"{kind}: mean loss {total / len(loader):.4f}")
"""


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    out = tmp_path_factory.mktemp("cross_replica")
    path = out / "program.py"
    path.write_text(PROGRAM)
    found = {}
    for kind in ("one_device", "mirrored_1", "mirrored_2"):
        result = run_job([sys.executable, str(path), kind], timeout=180, cwd=out)
        assert result.returncode == 0, result.logs()
        assert "Warning" not in result.output, result.output
        found[kind] = json.loads((out / f"{kind}.json").read_text())
    return found


@pytest.mark.parametrize("kind", ["one_device", "mirrored_1"])
def test_one_replica_returns_what_two_replicas_return(records, kind):
    assert records[kind]["replicas"] == 1 and records["mirrored_2"]["replicas"] == 2
    one = {k: v for k, v in records[kind].items() if k != "replicas"}
    two = {k: v for k, v in records["mirrored_2"].items() if k != "replicas"}
    assert one == two, (one, two)
    assert not any(one.values()), one  # values, detached from the replica's graph


def test_local_results_of_a_variable_are_the_variable_itself():
    import torch

    import phalanx as px

    strategy = px.OneDeviceStrategy("cpu")
    with strategy.scope():
        model = torch.nn.Linear(2, 1)
    assert strategy.experimental_local_results(model.weight)[0] is model.weight
    loss = strategy.run(lambda: model(torch.ones(1, 2)).sum())
    assert loss.requires_grad and not strategy.experimental_local_results(loss)[0].requires_grad
