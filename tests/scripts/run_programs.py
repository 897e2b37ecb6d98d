"""Test-only: runs several example programs one after the other in this process.

Each program runs as ``python PROGRAM ARGS`` would run it: as the ``__main__`` module (a fresh one
per program), with ``sys.argv`` set to ``[PROGRAM, *ARGS]`` and the program's folder first on
``sys.path``, in a working directory of its own (``./<index>``, so two programs' relative checkpoint
folders do not meet), and with Keras' global state cleared in between. Why: starting a Keras
process costs ~7 s of CPU, more than most of the examples' training; the tests that run every
example under every strategy therefore run one job per launcher instead of one per program. The
multi-replica strategies that later programs create run on the same replica processes, as they do
in TF's tutorials, which create several strategies in one program.

One difference from ``python PROGRAM``: the ``__main__`` module's ``__file__`` is this script's, so
that a strategy's self-launch (``python train.py`` with a multi-replica strategy restarts
``__main__.__file__`` for replicas 1..N-1) starts replicas that run this same plan. (None of the
examples reads ``__file__``.)

The plan comes from the environment, so that restarted replicas run it too:
``PHALANX_TEST_PROGRAMS`` is a JSON list of ``[PROGRAM, ARG, ...]`` lists; a program listed as
``["chief-only", PROGRAM, ARG, ...]`` runs on replica 0 only (a one-device run before the first
multi-replica strategy starts the other replicas: they skip it).

Each program's output is framed by ``<<< START <index>`` and ``<<< END <index>`` lines (see
``tests/conftest.py``'s ``program_output``), so that each test checks its own program's output and a
program that fails fails its own test by name. A failing program ends the job (its exception
propagates, as in a script of its own): the later programs do not run and their tests fail too.
"""

import builtins
import faulthandler
import json
import os
import sys
import types

from phalanx.config import stack_signal  # PHALANX_STACK_SIGNAL, as the test harness sends

faulthandler.register(stack_signal(), all_threads=True)
_PLAN = json.loads(os.environ["PHALANX_TEST_PROGRAMS"])
# The job's folder: replicas that a program's strategy starts begin in that program's folder.
_HOME = os.environ.setdefault("PHALANX_TEST_PROGRAMS_HOME", os.getcwd())
_PATH0 = sys.path[0]
_REPLICA = int(os.environ.get("PHALANX_RANK", "0"))


def _run(index: int, program: str, args: list[str]) -> None:
    workdir = os.path.join(_HOME, str(index))
    os.makedirs(workdir, exist_ok=True)
    os.chdir(workdir)
    sys.argv = [program, *args]
    sys.path[0] = os.path.dirname(os.path.abspath(program))
    main = types.ModuleType("__main__")
    main.__dict__.update(__file__=os.path.abspath(__file__), __builtins__=builtins)
    sys.modules["__main__"] = main
    with open(program) as f:
        code = compile(f.read(), program, "exec")
    exec(code, main.__dict__)
    sys.path[0] = _PATH0
    os.chdir(_HOME)
    if "keras" in sys.modules:
        sys.modules["keras"].backend.clear_session()


for _index, _entry in enumerate(_PLAN):
    if _entry[0] == "chief-only":
        if _REPLICA != 0:
            continue
        _entry = _entry[1:]
    print(f"<<< START {_index}", flush=True)
    _run(_index, _entry[0], _entry[1:])
    print(f"<<< END {_index}", flush=True)
