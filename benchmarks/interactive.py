"""What a notebook pays for multi-replica strategies: starting the replicas, and every cell after.

``python -m benchmarks.interactive [--cells 40] [--rounds 3]`` drives real Jupyter kernels
(ipykernel through jupyter_client), one per start method (fork, spawn), and measures from the
client, as a user waits for a cell:

* **start**: the cell ``strategy = phalanx.MirroredStrategy(["cpu:0", "cpu:1"])``, compared with
  the same cell for one device (``["cpu:0"]``: no replica to start) in the same kernel; the spawn
  kernel has run the same preceding cells, which its replica replays;
* **per cell**: a trivial cell (``x = 1``) before the strategy exists and after, interleaved in
  rounds; the difference is what shipping a cell to the replica and waiting for its outcome costs.

Writes ``benchmarks/results/interactive.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
PRELUDE = "import numpy as np, torch, keras, phalanx\nX = np.random.default_rng(0).normal(size=(1000, 20))"


class _Kernel:
    def __init__(self, env: dict[str, str]) -> None:
        import jupyter_client

        self.km = jupyter_client.KernelManager(kernel_name="python3")
        self.km.start_kernel(env={**os.environ, **env})
        self.kc = self.km.blocking_client()
        self.kc.start_channels()
        self.kc.wait_for_ready(timeout=120)

    def timed(self, code: str) -> float:
        """Seconds from sending the cell to its reply, as a notebook user waits for it."""
        start = time.perf_counter()
        msg_id = self.kc.execute(code)
        while True:
            reply = self.kc.get_shell_msg(timeout=300)
            if reply["parent_header"].get("msg_id") == msg_id:
                break
        elapsed = time.perf_counter() - start
        if reply["content"]["status"] != "ok":
            raise RuntimeError(f"cell failed: {code!r}: {reply['content'].get('evalue')}")
        return elapsed

    def close(self) -> None:
        self.kc.stop_channels()
        self.km.shutdown_kernel(now=False)


def _median_ms(values: list[float]) -> float:
    return round(1000 * statistics.median(values), 2)


def measure(method: str, cells: int, rounds: int) -> dict:
    env = {
        "KERAS_BACKEND": "torch",
        "OMP_NUM_THREADS": "1",
        "PHALANX_INTERACTIVE_START": method,
        "PHALANX_LOG_ROOT": tempfile.mkdtemp(prefix="phalanx-bench-logs-"),
    }
    kernel = _Kernel(env)
    try:
        kernel.timed(PRELUDE)
        before = [kernel.timed("x = 1") for _ in range(cells)]
        one = kernel.timed("one = phalanx.MirroredStrategy(['cpu:0'])")
        start = kernel.timed("strategy = phalanx.MirroredStrategy(['cpu:0', 'cpu:1'])")
        after: list[float] = []
        alone: list[float] = []
        for _ in range(rounds):  # interleaved: the host's drift hits both alike
            after += [kernel.timed("x = 1") for _ in range(cells)]
            kernel.timed("strategy.close()")
            alone += [kernel.timed("x = 1") for _ in range(cells)]
            kernel.timed("strategy = phalanx.MirroredStrategy(['cpu:0', 'cpu:1'])")
        return {
            "start_s": round(start, 3),
            "one_device_strategy_cell_s": round(one, 3),
            "cell_before_strategy_ms": _median_ms(before),
            "cell_without_replicas_ms": _median_ms(alone),
            "cell_with_replicas_ms": _median_ms(after),
            "per_cell_overhead_ms": round(_median_ms(after) - _median_ms(alone), 2),
        }
    finally:
        kernel.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cells", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    results = {method: measure(method, args.cells, args.rounds) for method in ("fork", "spawn")}
    results["host"] = {"cpus": os.cpu_count(), "load_avg_1min": round(os.getloadavg()[0], 2)}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "interactive.json").write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
