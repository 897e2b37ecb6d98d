"""Parameter-server test jobs. Every task runs this script; ps and worker tasks serve inside the
strategy's constructor and exit there, so everything after it runs on the chief only.

    python ps_job.py OUT_DIR MODE        (with TF_CONFIG and PHALANX_CLUSTER_SECRET set)

Modes (the chief writes OUT_DIR/<name>.json):
  converge   linear regression, one-device reference vs parameter-server training (converge.json),
             then worker faults (workers.json): a worker killed between functions, one killed
             mid-function, and both rejoining after the launcher restarts them
  ps_fault   checkpoints, then kill ps:1; measure the typed error and the shutdown
  resume     restart from the checkpoint ps_fault saved and finish
  serve      (no chief is started: the servers just serve, for the security test)
  lstsq      (run with --tls) train to the least-squares optimum; check that TLS is on and that a
             plain-text client cannot talk to a server (lstsq.json)
"""

import json
import os
import signal
import sys
import time
from pathlib import Path

import torch

import phalanx as px
from phalanx.coordinator import ClusterCoordinator
from phalanx.ps.errors import ParameterServerUnavailableError

T_START = time.time()
OUT, MODE = Path(sys.argv[1]), sys.argv[2]
TASK = json.loads(os.environ["TF_CONFIG"])["task"]
(OUT / f"pid_{TASK['type']}_{TASK['index']}").write_text(str(os.getpid()))

strategy = px.ParameterServerStrategy()
# ------------------------------------------------------------------------------ chief only from here

D, N, B, LR = 16, 4096, 128, 0.1
FINE_LR, FINE_STEPS = 0.02, 100  # the last steps at a lower rate: the final loss sits at the noise floor


def make_data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, D, generator=g)
    w = torch.randn(D, 1, generator=g)
    return x, x @ w + 0.1 * torch.randn(N, 1, generator=g)


class LinReg(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(D, 1)
        self.register_buffer("iterations", torch.zeros((), dtype=torch.int64))

    def forward(self, x):
        return self.linear(x)


def full_loss(model):
    x, y = make_data()
    with torch.no_grad():
        return torch.nn.functional.mse_loss(model(x), y).item()


def reference_loss(steps):
    """One-device training with the same batch size, learning rates and number of updates."""
    torch.manual_seed(1)
    model = LinReg()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    x, y = make_data()
    g = torch.Generator().manual_seed(7)
    for i in range(steps):
        if i == steps - FINE_STEPS:
            opt.param_groups[0]["lr"] = FINE_LR
        idx = torch.randint(0, N, (B,), generator=g)
        loss = torch.nn.functional.mse_loss(model(x[idx]), y[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
    return full_loss(model)


def dataset_fn(ctx):
    x, y = make_data()
    g = torch.Generator().manual_seed(100 + ctx.input_pipeline_id)

    def batches():
        count = 0
        while True:
            idx = torch.randint(0, N, (B,), generator=g)
            yield x[idx], y[idx], count
            count += 1

    return batches()


T_READY = time.time()
coordinator = ClusterCoordinator(strategy)
torch.manual_seed(1)
with strategy.scope():
    model = LinReg()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
iterator = iter(coordinator.create_per_worker_dataset(dataset_fn))


def step(it, slow=0.0, out=None):
    x, y, count = next(it)
    loss = torch.nn.functional.mse_loss(model(x), y)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    if slow:
        marker = Path(out) / f"inflight_{os.getpid()}"
        marker.write_text("")
        time.sleep(slow)
        marker.unlink()
    model.iterations += 1
    return loss.detach(), os.getpid(), count


def pid_of(task):
    return int((OUT / f"pid_{task}").read_text())


def write(result, name=MODE):
    result["t_start"], result["t_ready"] = T_START, T_READY
    (OUT / f"{name}.json").write_text(json.dumps(result, indent=1))


SEEN = []  # (worker pid, index of the batch it read) of every step


def train(n, **kwargs):
    values = [coordinator.schedule(step, args=(iterator,), kwargs=kwargs) for _ in range(n)]
    coordinator.join()
    SEEN.extend((pid, count) for _, pid, count in coordinator.fetch(values))
    return values


def set_lr(lr):
    for group in optimizer.param_groups:  # reaches the parameter servers with the next functions
        group["lr"] = lr


def wait_for_workers(timeout=90):
    """Every worker has started (their start-up takes seconds on a loaded host)."""
    deadline = time.monotonic() + timeout
    while min(w.completed for w in coordinator.workers) == 0 and time.monotonic() < deadline:
        coordinator.fetch([coordinator.schedule(time.sleep, args=(0.01,)) for _ in range(6)])


if MODE == "converge":
    STEPS = 300
    wait_for_workers()
    done_before = [w.completed for w in coordinator.workers]
    t = time.perf_counter()
    values = train(STEPS - FINE_STEPS)
    set_lr(FINE_LR)
    values += train(FINE_STEPS)
    elapsed = time.perf_counter() - t
    write(
        {
            "ps_loss": full_loss(model),
            "ref_loss": reference_loss(STEPS),
            "iterations": int(model.iterations),
            "steps_per_s": STEPS / elapsed,
            "per_worker": [w.completed - d for w, d in zip(coordinator.workers, done_before)],
            "updates": [s["updates"] for s in strategy.extended.parameter_server_stats()],
            "losses": [float(v.fetch()[0]) for v in values[-5:]],
        }
    )

    result = {}
    # Between functions: exactly N iterations.
    before = int(model.iterations)
    victim = pid_of("worker_1")
    os.kill(victim, signal.SIGKILL)
    time.sleep(0.3)
    train(30)
    result["between"] = {"expected": 30, "iterations": int(model.iterations) - before}
    # Mid-function: kill worker 2 while it sleeps inside a function.
    before = int(model.iterations)
    victim2 = pid_of("worker_2")
    values = [coordinator.schedule(step, args=(iterator,), kwargs={"slow": 0.2, "out": str(OUT)}) for _ in range(30)]
    deadline = time.monotonic() + 30
    while not (OUT / f"inflight_{victim2}").exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    in_flight = sum(w.state.value == "running" for w in coordinator.workers)
    os.kill(victim2, signal.SIGKILL)
    result["killed_mid_function"] = (OUT / f"inflight_{victim2}").exists()
    coordinator.join()
    fetched = [v.fetch() for v in values]
    SEEN.extend((pid, count) for _, pid, count in fetched)
    result["mid"] = {
        "scheduled": 30,
        "in_flight": in_flight,
        "iterations": int(model.iterations) - before,
        "all_fetched": len(fetched) == 30,
        "ran_on_victim": sum(p == victim2 for _, p, _ in fetched),
    }
    # The supervisor restarts the killed workers; the coordinator reconnects and gives them work.
    result["t_restart_wait"] = time.time()
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        restarted = {pid_of("worker_1"), pid_of("worker_2")} - {victim, victim2}
        if len(restarted) == 2 and restarted <= {pid for pid, _ in SEEN}:
            break
        train(6)
        time.sleep(0.2)
    # The first batch each restarted worker read: 0 when its per-worker dataset was built again.
    result["restarted_first_batch"] = [min(c for p, c in SEEN if p == pid) for pid in sorted(restarted)]
    result["failures_seen"] = [w.failures for w in coordinator.workers]
    result["loss"] = full_loss(model)
    result["ref_loss"] = reference_loss(300)
    result["t_end"] = time.time()
    write(result, "workers")

elif MODE == "ps_fault":
    ckpt = OUT / "ckpt.pt"
    for _ in range(3):
        train(20)
        torch.save({"model": model.state_dict(), "step": int(model.iterations)}, ckpt)
    values = [coordinator.schedule(step, args=(iterator,)) for _ in range(200)]
    time.sleep(0.2)
    t_kill = time.time()
    os.kill(pid_of("ps_1"), signal.SIGKILL)
    error = None
    try:
        coordinator.join()
    except ParameterServerUnavailableError as e:
        error = e
    t_err = time.time()
    try:
        coordinator.schedule(step, args=(iterator,))
        schedule_raised = None
    except Exception as e:  # noqa: BLE001
        schedule_raised = type(e).__name__
    t0 = time.time()
    coordinator.shutdown()
    shutdown_s = time.time() - t0
    write(
        {
            "error": type(error).__name__ if error else None,
            "message": str(error),
            "t_kill": t_kill,
            "t_err": t_err,
            "detect_s": t_err - t_kill,
            "schedule_raised": schedule_raised,
            "shutdown_s": shutdown_s,
            "checkpoint_step": torch.load(ckpt, weights_only=True)["step"],
            "rpc_timeout": strategy.extended.rpc_timeout,
        }
    )

elif MODE == "resume":
    state = torch.load(OUT / "ckpt.pt", weights_only=True)
    model.load_state_dict(state["model"])  # sent to the parameter servers before the next schedule
    start = int(model.iterations)
    steps = []
    for k in range(4):
        if k == 3:
            set_lr(FINE_LR)
        train(60)
        steps.append(int(model.iterations))
    write({"start": start, "steps": steps, "loss": full_loss(model), "ref_loss": reference_loss(300)})

elif MODE == "lstsq":
    from phalanx.ps import wire
    from phalanx.ps.transport import GrpcTransport, TransportError

    wait_for_workers()
    for lr, steps in ((LR, 200), (FINE_LR, 100), (FINE_LR / 4, 100)):
        set_lr(lr)
        train(steps)
    x, y = make_data()
    solution = torch.linalg.lstsq(torch.cat([x, torch.ones(N, 1)], 1), y).solution
    optimum = torch.nn.functional.mse_loss(torch.cat([x, torch.ones(N, 1)], 1) @ solution, y).item()
    learned = torch.cat([model.linear.weight.detach().reshape(-1), model.linear.bias.detach()])
    from phalanx.ps.tls import TlsConfig

    tls = TlsConfig.from_env()  # what this task's transport uses
    address = json.loads(os.environ["TF_CONFIG"])["cluster"]["ps"][0]
    channel = GrpcTransport(tls=None).connect(address, "phalanx.ParameterServer")
    try:
        channel.call("ping", wire.Signer(wire.cluster_secret(), "chief:0").encode("ping").chunks(), timeout=5)
        plaintext = "ok"
    except TransportError as e:
        plaintext = e.code
    channel.close()
    write(
        {
            "loss": full_loss(model),
            "optimum": optimum,
            "weight_error": (learned - solution.reshape(-1)).abs().max().item(),
            "tls": tls is not None,
            "mutual": bool(tls and tls.mutual),
            "plaintext": plaintext,
        }
    )
