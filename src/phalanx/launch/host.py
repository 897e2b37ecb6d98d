"""The program hosting this interpreter, when it is not ``python`` itself (R through reticulate).

An *embedded* interpreter runs inside another program: R's reticulate loads libpython into the R
process. Its ``sys.executable`` and ``sys.argv`` name a Python (reticulate sets both), but the
process is R's: starting "the same command again" must start R with the R program, and the host
runs no Python exit handlers (reticulate never finalizes Python, so :mod:`atexit` does not run).
Forking such a process is no way to start a replica either: the copy shares the host's input
(R reads ``Rscript script.R`` through one file position both copies move) and, on exit, runs the
host's clean-up (R deletes its ``tempdir()``, which both copies name).

What phalanx does instead (:mod:`phalanx.launch.self_launch`): replica ``k`` is a fresh host
process running the host's own command line again (``Rscript script.R``, ``Rscript -e
'source("script.R")'``), with the replica's identity in its environment, as for ``python
train.py``. A host whose command line does not hold its program (an R console, ``R <
script.R``, ``Rscript -``) gets a :class:`~phalanx.errors.LaunchError` saying how to run it.
"""

from __future__ import annotations

import os
import sys

from phalanx.errors import LaunchError


def embedded() -> bool:
    """Whether this interpreter runs inside another program rather than as ``python``.

    CPython's own ``python`` command always records its command line in ``sys.orig_argv`` (3.10+);
    an interpreter initialised by an embedding program (``Py_Initialize``, as reticulate does)
    has none.
    """
    return not getattr(sys, "orig_argv", ["python"])


def _executable() -> str:
    try:
        return os.readlink("/proc/self/exe")
    except OSError:  # no /proc (not Linux): the host cannot be started again from here
        return ""


def _command_line() -> list[str]:
    try:
        with open("/proc/self/cmdline", "rb") as f:
            raw = f.read()
    except OSError:
        return []
    return [os.fsdecode(part) for part in raw.split(b"\0")[:-1]]


def name() -> str:
    """What hosts this interpreter: ``"R"`` for R (reticulate), else the host executable's name."""
    exe = os.path.basename(_executable())
    if "rpytools" in sys.modules or exe == "R":
        return "R"
    return exe or "an unknown program"


def command() -> list[str]:
    """The command line that runs the host's program again, its script made absolute.

    Raises:
        LaunchError: the host's command line does not hold its program (an R console, a script
            read from stdin), or the host is not one phalanx knows how to start again.
    """
    host, argv = name(), _command_line()
    if host != "R" or not argv:
        raise LaunchError(
            f"A multi-replica strategy cannot start its replicas from Python embedded in {host}: "
            "phalanx does not know how to start this program again.",
            hint="start one process per replica yourself, each with TF_CONFIG (or torchrun's RANK, "
            "WORLD_SIZE, MASTER_ADDR, MASTER_PORT) set",
        )
    return _r_command(argv)


def _r_command(argv: list[str]) -> list[str]:
    """R's command line (``/usr/lib/R/bin/exec/R --no-echo --file=script.R --args ...``), runnable again.

    ``Rscript script.R`` runs R with ``--file=script.R``; ``Rscript -e EXPR`` with ``-e EXPR``; the
    user's arguments follow ``--args``. The replicas start in this process's working directory.
    """
    out = [_executable() or argv[0]]
    program = False
    i = 1
    while i < len(argv):
        arg = argv[i]
        if arg == "--args":
            out += argv[i:]
            break
        if arg.startswith("--file=") or arg == "-f":
            path = arg.split("=", 1)[1] if arg.startswith("--file=") else (argv[i + 1] if i + 1 < len(argv) else "")
            i += 1 if arg == "-f" else 0
            if path in ("", "-"):
                break  # the program comes from stdin: it cannot be read again
            if not os.path.isfile(path):
                raise LaunchError(
                    f"R runs the script {path!r}, which is not found from the working directory "
                    f"{os.getcwd()!r}: the replicas cannot run it again.",
                    hint="give Rscript the script's absolute path, or create the strategy before setwd()",
                )
            out.append("--file=" + os.path.abspath(path))
            program = True
        elif arg == "-e" and i + 1 < len(argv):
            out += [arg, argv[i + 1]]
            program = True
            i += 1
        else:
            out.append(arg)
        i += 1
    if not program:
        raise LaunchError(
            "A multi-replica strategy in R needs the R program on R's command line, to run it again "
            "as each replica; this R session reads its program from a console or stdin.",
            hint="save the code to script.R and run `Rscript script.R` (or `Rscript -e 'source(\"script.R\")'`)",
        )
    return out
