"""The ``phalanx`` command: ``run`` (launch a job), ``demo`` (the main example), ``bench``.

Examples::

    phalanx run -n 2 train.py --epochs 3          # 2 replicas on this host
    phalanx run --nnodes 2 --node-rank 0 --master 10.0.0.1:29500 -n 1 train.py
    phalanx run --ps 2 --workers 3 train.py       # a parameter-server cluster on this host
    phalanx demo --strategy all --epochs 10
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence


def _master(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        raise argparse.ArgumentTypeError(f"--master must be HOST:PORT with a port in 1..65535; received {text!r}")
    return host.strip("[]"), int(port)


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer; received {text!r}")
    return int(text)


def _run(args: argparse.Namespace) -> int:
    from phalanx.launch.runner import JobSpec, run_job

    if args.module:
        args.command = ["-m", args.module, *args.command]
    if not args.command:
        print("phalanx run: give the script to run, e.g. `phalanx run -n 2 train.py`", file=sys.stderr)
        return 2
    host, port = args.master or ("127.0.0.1", 0)
    if args.nnodes > 1 and not args.master:
        print("phalanx run: --nnodes > 1 needs --master HOST:PORT (the node-rank-0 host)", file=sys.stderr)
        return 2
    if not 0 <= args.node_rank < args.nnodes:
        print(f"phalanx run: --node-rank must be in [0, {args.nnodes}); received {args.node_rank}", file=sys.stderr)
        return 2
    command = tuple(args.command[1:] if args.command[0] == "--" else args.command)
    if (args.ps or args.workers) and (args.ps < 1 or args.workers < 1 or args.nproc != 1 or args.nnodes != 1):
        print("phalanx run: a parameter-server cluster needs both --ps N and --workers N (>= 1), without "
              "-n or --nnodes", file=sys.stderr)
        return 2
    if args.tls and not args.ps:
        print("phalanx run: --tls is for parameter-server clusters (--ps N --workers M); collectives run over "
              "torch.distributed, which has no TLS", file=sys.stderr)
        return 2
    spec = JobSpec(command=command, nproc=args.nproc, nnodes=args.nnodes, node_rank=args.node_rank,
                   master_addr=host, master_port=port, max_restarts=args.max_restarts, log_dir=args.log_dir or "",
                   ps=args.ps, workers=args.workers, tls=args.tls)
    return run_job(spec)


def _bench(args: argparse.Namespace) -> int:
    import os
    import subprocess
    from pathlib import Path

    # The suite lives in the repository's benchmarks/ (it compares against DDP and raw gloo, which
    # the installed package does not need); find it from the current directory or the source tree.
    for root in (Path.cwd(), Path(__file__).resolve().parents[2]):
        if (root / "benchmarks" / "__main__.py").exists():
            env = {**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
            return subprocess.call([sys.executable, "-m", "benchmarks", *args.args], cwd=root, env=env)
    print("phalanx bench: run it from a source checkout of phalanx (benchmarks/ not found)", file=sys.stderr)
    return 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="phalanx", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)

    run = sub.add_parser("run", help="start the replica processes of a training script")
    run.add_argument("-n", "--nproc", "--nproc-per-node", type=_positive, default=1,
                     help="replica processes on this host (default 1)")
    run.add_argument("--nnodes", type=_positive, default=1, help="number of hosts")
    run.add_argument("--node-rank", type=int, default=0, help="this host's index, 0..nnodes-1")
    run.add_argument("--master", type=_master, default=None, help="HOST:PORT of node 0's rendezvous")
    run.add_argument("--max-restarts", type=int, default=0,
                     help="restart the whole group up to K times (with --ps: restart each failed worker up to K times)")
    run.add_argument("--ps", type=int, default=0, help="parameter servers of a local ParameterServerStrategy cluster")
    run.add_argument("--workers", type=int, default=0, help="workers of a local ParameterServerStrategy cluster")
    run.add_argument("--tls", action="store_true",
                     help="with --ps: TLS between the tasks, with a throwaway CA and certificate made for this run")
    run.add_argument("--log-dir", default=None, help="where per-replica logs go (default: a temp dir)")
    run.add_argument("-m", dest="module", default=None, help="run a module (as `python -m`) instead of a script")
    run.add_argument("command", nargs=argparse.REMAINDER, help="script.py [args...] (or the module's args)")
    run.set_defaults(func=_run)

    bench = sub.add_parser("bench", help="run the benchmark suite (python -m benchmarks) from a source checkout")
    bench.add_argument("args", nargs=argparse.REMAINDER, help="options of python -m benchmarks, e.g. --rounds 3")
    bench.set_defaults(func=_bench)

    demo = sub.add_parser("demo", help="train the seed MLP on scikit-learn's digits under each strategy")
    from phalanx.demo import add_arguments, main as demo_main

    add_arguments(demo)
    demo.set_defaults(func=demo_main)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
