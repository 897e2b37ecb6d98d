"""The ``phalanx`` command: ``run`` (launch a job), ``demo`` (the main example), ``bench``.

Examples::

    phalanx run -n 2 train.py --epochs 3          # 2 replicas on this host
    phalanx run --nnodes 2 --node-rank 0 --master 10.0.0.1:29500 -n 1 train.py
    phalanx run --ps 2 --workers 3 train.py       # a parameter-server cluster on this host
    phalanx demo --strategy all --epochs 10
    phalanx bench --quick                          # forwards its options to python -m benchmarks
    phalanx diagnose --live                        # where each replica of the newest run is, now
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Sequence

from phalanx.launch.cores import cpu_oversubscription_warning
from phalanx.launch.stdio import flush_quietly, own_streams


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
        print(
            "phalanx run: a parameter-server cluster needs both --ps N and --workers N (>= 1), without -n or --nnodes",
            file=sys.stderr,
        )
        return 2
    if args.min_nproc and not 1 <= args.min_nproc <= args.nproc * args.nnodes:
        print(
            f"phalanx run: --min-nproc must be between 1 and the job's {args.nproc * args.nnodes} replicas; "
            f"received {args.min_nproc}",
            file=sys.stderr,
        )
        return 2
    if args.max_nproc and not args.min_nproc:
        print("phalanx run: --max-nproc is for an elastic job (with --min-nproc)", file=sys.stderr)
        return 2
    if args.min_nproc and (args.ps or args.nnodes > 1):
        print(
            "phalanx run: --min-nproc is for the replicas of one host (a parameter-server cluster recovers its "
            "workers with --max-restarts)",
            file=sys.stderr,
        )
        return 2
    if args.tls and not args.ps:
        print(
            "phalanx run: --tls is for parameter-server clusters (--ps N --workers M); collectives run over "
            "torch.distributed, which has no TLS",
            file=sys.stderr,
        )
        return 2
    if args.debug:  # the replicas' configuration errors show phalanx's frames too
        os.environ["PHALANX_DEBUG"] = "1"
    problem = _configuration_problem(ps=args.ps > 0)
    if problem is not None:  # before any replica starts (and imports torch) only to find it
        print(f"phalanx run: {problem}", file=sys.stderr)
        return 2
    warning = _oversubscription_warning(args.nproc)
    if warning:
        print(warning, file=sys.stderr)
    start_method = args.start_method or ""
    preload = tuple(m.strip() for m in args.preload.split(",") if m.strip())
    if args.ps > 0:
        # The parameter-server wing plans its cluster (roles, addresses, TLS material) and runs it
        # on launch/'s Supervisor; launch/ itself knows nothing of parameter servers.
        from phalanx.launch import settings
        from phalanx.ps.cluster_launcher import ClusterJob, run_cluster

        return run_cluster(
            ClusterJob(
                command,
                args.ps,
                args.workers,
                args.max_restarts,
                args.log_dir or "",
                tee=args.tee,
                tls=args.tls,
                start_method=start_method or settings.start_method(),
                preload=preload,
            )
        )
    spec = JobSpec(
        command=command,
        nproc=args.nproc,
        nnodes=args.nnodes,
        node_rank=args.node_rank,
        master_addr=host,
        master_port=port,
        max_restarts=args.max_restarts,
        log_dir=args.log_dir or "",
        tee=args.tee,
        start_method=start_method,
        preload=preload,
        min_nproc=args.min_nproc,
        max_nproc=args.max_nproc,
    )
    return run_job(spec)


def _configuration_problem(*, ps: bool) -> str | None:
    """What is wrong with the job's configuration in this environment, found before it starts: a
    malformed ``PHALANX_*`` setting, or a TF_CONFIG that every replica would refuse (a parameter-server
    cluster's tasks get theirs from the launcher). None when nothing is."""
    from phalanx.config import Settings
    from phalanx.errors import ClusterSpecError

    try:
        Settings.from_environ()
    except ClusterSpecError as e:
        return str(e)
    if ps or not os.environ.get("TF_CONFIG", "").strip():
        return None
    from phalanx.cluster.tfconfig import TFConfigClusterResolver

    try:
        TFConfigClusterResolver()
    except ClusterSpecError as e:
        return f"TF_CONFIG: {e}"
    return None


def _visible_gpus() -> int:
    """CUDA devices this process sees; 0 without importing torch on a host with no NVIDIA driver.

    Only a host with the driver can have CUDA devices: elsewhere the launcher spares itself
    importing torch (1.5 s of CPU) just to count none.
    """
    if not (os.path.exists("/proc/driver/nvidia") or os.path.exists("/dev/nvidiactl")):
        return 0
    import torch

    return torch.cuda.device_count()


def _oversubscription_warning(nproc: int) -> str | None:
    """A warning when ``-n`` starts more replica processes than this host has GPUs or CPU cores.

    More replicas than devices still trains correctly (useful for testing), but replicas then
    share a device, and every synchronous step waits for the slowest of them.
    """
    gpus = _visible_gpus()
    if gpus:
        if nproc > gpus:
            return (
                f"phalanx run: warning: -n {nproc} starts {nproc} replicas on {gpus} GPU(s); replicas past "
                f"GPU {gpus - 1} have no GPU of their own. Use -n {gpus} or fewer for one replica per GPU."
            )
        return None
    # A self-launching strategy warns in the same words (phalanx.launch.cores).
    return cpu_oversubscription_warning(nproc, who="phalanx run", what=f"-n {nproc}", fewer="-n {cores}")


def _bench(args: argparse.Namespace) -> int:
    import subprocess
    from pathlib import Path

    forwarded = list(args.forwarded)
    # The suite runs from the repository root; a relative --out means the user's directory.
    for i, arg in enumerate(forwarded):
        if arg == "--out" and i + 1 < len(forwarded):
            forwarded[i + 1] = str(Path(forwarded[i + 1]).resolve())
        elif arg.startswith("--out="):
            forwarded[i] = "--out=" + str(Path(arg[len("--out=") :]).resolve())
    # The suite lives in the repository's benchmarks/ (it compares against DDP and raw gloo, which
    # the installed package does not need); find it from the current directory or the source tree.
    for root in (Path.cwd(), Path(__file__).resolve().parents[2]):
        if (root / "benchmarks" / "__main__.py").exists():
            env = {**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
            # `python -m benchmarks` with the command the user typed as its name (usage, examples).
            run_suite = (
                "import sys; from benchmarks.__main__ import main; sys.exit(main(sys.argv[1:], prog='phalanx bench'))"
            )
            return subprocess.call([sys.executable, "-c", run_suite, *forwarded], cwd=root, env=env)
    print("phalanx bench: run it from a source checkout of phalanx (benchmarks/ not found)", file=sys.stderr)
    return 2


def _newest_run(root: str) -> str | None:
    """The newest run directory under the log root (run ids sort by start time)."""
    import re

    try:
        names = sorted(n for n in os.listdir(root) if re.match(r"^\d{8}-\d{6}-[0-9a-f]{6}$", n))
    except OSError:
        return None
    return os.path.join(root, names[-1]) if names else None


def _diagnose(args: argparse.Namespace) -> int:
    """``phalanx diagnose [RUN_DIR] [--live]``: the diagnosis of a run, kept or asked for now."""
    from phalanx.comm import diagnosis

    run_dir = args.run_dir
    if run_dir is None:
        from phalanx.launch import settings

        run_dir = _newest_run(settings.log_root())
        if run_dir is None:
            print(f"phalanx diagnose: no run directory under {settings.log_root()}; name one", file=sys.stderr)
            return 2
    if not os.path.isdir(run_dir):
        print(f"phalanx diagnose: {run_dir!r} is not a directory (a run's LOGDIR/<run-id>)", file=sys.stderr)
        return 2
    if not args.live:
        found = diagnosis.read(run_dir)
        if found is None:
            print(
                f"phalanx diagnose: {run_dir} holds no diagnosis (no collective of that run failed); "
                "`phalanx diagnose --live` asks a running job",
                file=sys.stderr,
            )
            return 1
        print(json.dumps(found, indent=1) if args.json else diagnosis.render(found))
        return 0
    from phalanx.comm import snapshot

    answers = snapshot.ask_directory(run_dir, args.wait)
    if not answers:
        print(
            f"phalanx diagnose: no replica of {run_dir} answered within {args.wait:g} s (has the job ended? a "
            "replica answers from its heartbeat thread once its strategy is built)",
            file=sys.stderr,
        )
        return 1
    world = max(int(s.get("world_size") or 0) for s in answers.values())
    absent = {r: "silent: it did not answer (another host, or it has ended)" for r in range(world) if r not in answers}
    found = diagnosis.analyse(answers, world, absent=absent, live=True)
    print(json.dumps(found, indent=1) if args.json else diagnosis.render(found))
    return 0


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Keeps the examples' layout and appends each option's default (when it has a meaningful one)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (
            "%(default)" not in text
            and action.option_strings
            and action.nargs != 0
            and not any(action.default is v for v in (None, False, "", argparse.SUPPRESS))
        ):
            text += " (default: %(default)s)"
        return text


_RUN_EXAMPLES = """examples:
  phalanx run -n 2 train.py --epochs 3        # 2 replica processes on this host
  phalanx run -n 2 -m mypackage.train         # a module, as python -m
  phalanx run -n 2 --max-restarts 3 train.py  # restart the whole group after a failure
  phalanx run -n 3 --min-nproc 2 train.py     # go on with 2 replicas if one is lost
  phalanx run --nnodes 2 --node-rank 0 --master 10.0.0.1:29500 -n 2 train.py   # host 0 of 2
  TF_CONFIG='{...}' phalanx run -n 2 train.py   # this host's replicas of a TF_CONFIG cluster
  phalanx run --ps 2 --workers 3 train.py     # a ParameterServerStrategy cluster on this host

Arguments after the script go to the script. Replica 0 writes to this terminal; the other
replicas' logs go to files whose directory is printed once."""

_TOP_EXAMPLES = """examples:
  phalanx demo                       # train a small model under OneDevice and Mirrored, print a table
  phalanx run -n 2 train.py          # run your script as 2 replica processes
  phalanx bench --quick              # a short benchmark run (from a source checkout)
  phalanx diagnose --live            # where each replica of the newest run is, without stopping it
  phalanx <command> --help           # a command's options

documentation: README.md in the source repository"""


def _version() -> str:
    import platform

    import torch

    from phalanx import __version__

    return f"phalanx {__version__} (torch {torch.__version__}, Python {platform.python_version()})"


class _VersionAction(argparse.Action):
    """``--version``, importing torch for its version only when asked (``phalanx run`` never is)."""

    def __init__(self, option_strings: Sequence[str], dest: str = argparse.SUPPRESS, **kwargs: object) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, help="show the versions and exit")

    def __call__(self, parser: argparse.ArgumentParser, *args: object, **kwargs: object) -> None:
        print(_version())  # to stdout, as argparse's own version action
        parser.exit()


def parse(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """``argv`` parsed; for ``run -m MODULE``, everything after MODULE is the module's, as after
    ``python -m``: argparse alone would read ``--worker`` there as ``run``'s ``--workers``."""
    if argv[:1] == ["run"] and "-m" in argv[:-1]:
        at = argv.index("-m") + 2
        args = parser.parse_args(argv[:at])
        if not args.command:  # "-m" was run's own, not an argument of a script named before it
            args.command = argv[at:]
            return args
    return parser.parse_args(argv)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="phalanx",
        formatter_class=_HelpFormatter,
        epilog=_TOP_EXAMPLES,
        description="TensorFlow's tf.distribute strategies for PyTorch and Keras: launch a job, run the demo, "
        "or benchmark.",
    )
    parser.add_argument("--version", action=_VersionAction)
    sub = parser.add_subparsers(dest="cmd", metavar="{run,demo,bench,diagnose}")

    run = sub.add_parser(
        "run",
        help="start the replica processes of a training script",
        description="Start the replica processes of a training script and supervise them: the "
        "first failure is reported as the root cause and stops the others.",
        epilog=_RUN_EXAMPLES,
        formatter_class=_HelpFormatter,
    )
    run.add_argument(
        "-n",
        "--nproc",
        "--nproc-per-node",
        type=_positive,
        default=1,
        metavar="N",
        help="replica processes on this host (one per GPU, or CPU replicas)",
    )
    run.add_argument("--nnodes", type=_positive, default=1, metavar="N", help="number of hosts")
    run.add_argument("--node-rank", type=int, default=0, metavar="K", help="this host's index, 0..nnodes-1")
    run.add_argument(
        "--master",
        type=_master,
        default=None,
        metavar="HOST:PORT",
        help="node 0's rendezvous address (needed with --nnodes > 1)",
    )
    run.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        metavar="K",
        help="restart the whole group up to K times (with --ps: restart each failed worker up to K times)",
    )
    run.add_argument(
        "--min-nproc",
        type=_positive,
        default=0,
        metavar="M",
        help="elastic: when replicas are lost (killed, out of memory), the others go on within the step "
        "while at least M remain (MirroredStrategy, MultiWorkerMirroredStrategy; docs/elastic.md)",
    )
    run.add_argument(
        "--max-nproc",
        type=_positive,
        default=0,
        metavar="N",
        help="elastic: a lost replica is replaced while fewer than N run (default: -n); the replacement "
        "joins at a step boundary with a live replica's state",
    )
    run.add_argument(
        "--ps",
        type=int,
        default=0,
        metavar="M",
        help="parameter servers of a local ParameterServerStrategy cluster (with --workers)",
    )
    run.add_argument(
        "--workers",
        type=int,
        default=0,
        metavar="N",
        help="workers of a local ParameterServerStrategy cluster (with --ps)",
    )
    run.add_argument(
        "--tls",
        action="store_true",
        help="with --ps: TLS between the tasks, with a throwaway CA and certificate made for this run",
    )
    run.add_argument(
        "--log-dir",
        default=None,
        metavar="DIR",
        help="log root: each run writes DIR/<run-id>/replica_<k>.log (default: $PHALANX_LOG_ROOT "
        "or <tmp>/phalanx-logs; the last $PHALANX_KEEP_RUNS runs, default 10, of each script, user and host "
        "are kept)",
    )
    run.add_argument(
        "--tee",
        action="store_true",
        help="also show every replica's output here, each line prefixed with the replica's name",
    )
    run.add_argument(
        "--start-method",
        choices=("fork", "spawn"),
        default=None,
        help="fork: every replica is forked from a process that imported torch (and Keras) once; spawn: "
        "each starts a fresh interpreter (default: $PHALANX_START_METHOD, else fork on Linux)",
    )
    run.add_argument(
        "--preload",
        default="",
        metavar="MODULES",
        help="with the fork start: modules (comma-separated) to import once besides torch and those the "
        "script imports itself, e.g. --preload keras for a script that imports Keras through a module of its own",
    )
    run.add_argument(
        "--debug",
        action="store_true",
        help="show phalanx's own frames in a configuration error's traceback (sets PHALANX_DEBUG=1 for the job)",
    )
    run.add_argument(
        "-m", dest="module", default=None, metavar="MODULE", help="run a module (as python -m does) instead of a script"
    )
    run.add_argument(
        "command",
        nargs=argparse.REMAINDER,
        metavar="script.py [args ...]",
        help="the training script and its arguments",
    )
    run.set_defaults(func=_run)

    demo = sub.add_parser(
        "demo",
        help="train a small MLP on scikit-learn's digits under each strategy",
        description="Train a small MLP (Dense 128 relu, Dropout 0.2, Dense 10) on scikit-learn's "
        "bundled 8x8 digits under OneDeviceStrategy and MirroredStrategy and print a "
        "table of epoch time, throughput and accuracy. Needs the demo extra.",
        epilog="examples:\n  phalanx demo\n  phalanx demo --strategy mirrored --replicas 2 --epochs 5",
        formatter_class=_HelpFormatter,
    )
    from phalanx.demo import add_arguments
    from phalanx.demo import main as demo_main

    add_arguments(demo)
    demo.set_defaults(func=demo_main)

    diagnose = sub.add_parser(
        "diagnose",
        help="say where each replica of a run is, and why it hung (kept, or asked now with --live)",
        description="Print the diagnosis of a run: where each replica was (in which collective, from which "
        "line; or in its own code), where their collectives parted, and the cause. A replica whose "
        "collective failed writes it to the run directory, where the launcher printed it; --live asks the "
        "replicas of a running job now, without stopping it.",
        epilog="examples:\n  phalanx diagnose                      # the newest run's kept diagnosis\n"
        "  phalanx diagnose /tmp/phalanx-logs/20261128-101500-1a2b3c\n"
        "  phalanx diagnose --live               # the newest run, now",
        formatter_class=_HelpFormatter,
    )
    diagnose.add_argument(
        "run_dir",
        nargs="?",
        default=None,
        metavar="RUN_DIR",
        help="the run's directory, LOGDIR/<run-id> (default: the newest under $PHALANX_LOG_ROOT or <tmp>/phalanx-logs)",
    )
    diagnose.add_argument("--live", action="store_true", help="ask the running job's replicas now")
    diagnose.add_argument(
        "--wait", type=float, default=3.0, metavar="S", help="with --live: how long to wait for the replicas' answers"
    )
    diagnose.add_argument("--json", action="store_true", help="print the diagnosis as JSON")
    diagnose.set_defaults(func=_diagnose)

    # bench's options belong to python -m benchmarks: everything after `bench` is forwarded
    # (see main), so `phalanx bench --help` shows the suite's own help.
    bench = sub.add_parser(
        "bench", add_help=False, help="run the benchmark suite from a source checkout (options: phalanx bench --help)"
    )
    bench.set_defaults(func=_bench)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from_command_line = argv is None
    if from_command_line:
        # Started with a closed stdout, stderr or stdin (a daemon's, `>&-`): /dev/null there, so
        # that no file, socket or child of the launcher lands on a standard descriptor.
        own_streams()
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:  # forward everything verbatim: argparse would reorder or reject options
        return _bench(argparse.Namespace(forwarded=argv[1:]))
    args = parse(parser, argv)
    if args.cmd is None:
        parser.print_help(sys.stderr)
        print(
            "\nphalanx: give a command: start with 'phalanx demo', or run your script with 'phalanx run -n 2 train.py'",
            file=sys.stderr,
        )
        return 2
    code = int(args.func(args) or 0)
    if from_command_line and args.func is _run:
        # The launcher is done (every replica has ended) and nothing is left to clean up: end now,
        # so the job's exit status never waits on the interpreter's teardown (seconds under load
        # when the launcher still imported torch). A stdout whose reader went away (`| head -1`)
        # must not turn the job's status into a failure.
        flush_quietly()
        os._exit(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
