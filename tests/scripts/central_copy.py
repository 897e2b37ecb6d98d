"""CentralStorageStrategy in copy mode (GPU replicas' code path, forced on CPU replicas).

Usage: PHALANX_CENTRAL_COPY=1 python central_copy.py OUT_DIR OPTIMIZER[,OPTIMIZER...] N

Trains the model of ``equivalence.py`` on N replicas. Replica 0 also trains it on one device
(the reference). Each replica writes ``copy_{rank}.pt``: the parameters it computes with in a
final ``run`` (its compute copy), the parameters seen outside ``run``, and (replica 0) the
reference; and ``copy_{rank}.json``: where the parameters and the optimizer state were. Several
optimizers: one after the other in the same processes, each with a fresh strategy and model,
written to ``OUT_DIR/OPTIMIZER/``.
"""

import faulthandler
import json
import os
import sys

import torch

from phalanx.config import stack_signal  # PHALANX_STACK_SIGNAL, as the test harness sends

faulthandler.register(stack_signal(), all_threads=True)  # a hung job dumps its stacks

from equivalence import GLOBAL_BATCH, data, make_model, make_optimizer, reference

import phalanx as px


def run(out, opt_name, n):
    strategy = px.CentralStorageStrategy([f"cpu:{i}" for i in range(n)])
    ext = strategy.extended
    rank = ext.process_index
    ref = reference(opt_name).state_dict() if rank == 0 else None

    torch.manual_seed(0 if rank == 0 else 99)  # the initial broadcast must make replicas equal
    with strategy.scope():
        model = make_model()
        opt = make_optimizer(opt_name, model.parameters())
    params = list(model.parameters())
    central = [ext.central_copy_of(p).data_ptr() for p in params]
    seen = {"forward_on_compute_copy": [], "step_on_central_copy": [], "step_devices": set()}

    def step(x, y):
        seen["forward_on_compute_copy"].append(all(p.data_ptr() != c for p, c in zip(params, central)))
        per_example = ((model(x) - y) ** 2).mean(dim=1)
        loss = px.nn.compute_average_loss(per_example, global_batch_size=GLOBAL_BATCH)
        opt.zero_grad()
        loss.backward()
        if rank == 0:  # the optimizer must see the central copy and the summed gradient, on the CPU
            seen["step_on_central_copy"].append(all(p.data_ptr() == c for p, c in zip(params, central)))
            seen["step_devices"] |= {str(t.device) for p in params for t in (p, p.grad)}
        else:
            assert all(p.grad is None for p in params), "a non-chief replica kept gradients"
        opt.step()
        return loss

    for x, y in strategy.experimental_distribute_dataset(data()):
        strategy.run(step, args=(x, y))
    outside = {k: v.detach().clone() for k, v in model.state_dict().items()}
    outside_on_central = all(p.data_ptr() == c for p, c in zip(params, central))
    computed = strategy.run(lambda: {k: v.detach().clone() for k, v in model.state_dict().items()})
    computed = strategy.experimental_local_results(computed)[rank]
    torch.save({"computed": computed, "outside": outside, "reference": ref}, os.path.join(out, f"copy_{rank}.pt"))
    state = [t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    with open(os.path.join(out, f"copy_{rank}.json"), "w") as f:
        json.dump(
            {
                "copy_mode": ext._copy_mode,
                "worker_devices": list(ext.worker_devices),
                "parameter_devices": list(ext.parameter_devices),
                "forward_on_compute_copy": all(seen["forward_on_compute_copy"]),
                "steps": len(seen["forward_on_compute_copy"]),
                "step_on_central_copy": all(seen["step_on_central_copy"]) and bool(seen["step_on_central_copy"]),
                "step_devices": sorted(seen["step_devices"]),
                "outside_on_central": outside_on_central,
                "params_with_state": len(opt.state),
                "num_params": len(params),
                "state_devices": sorted({str(t.device) for t in state}),
                "state_bytes": sum(t.numel() * t.element_size() for t in state),
            },
            f,
        )
    strategy.close()


if __name__ == "__main__":
    root, n = sys.argv[1], int(sys.argv[3])
    for opt_name in sys.argv[2].split(","):
        out = os.path.join(root, opt_name)
        os.makedirs(out, exist_ok=True)
        run(out, opt_name, n)
