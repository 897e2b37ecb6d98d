"""Test-only: runs several example programs one after the other in this process.

Each program runs as ``python PROGRAM ARGS`` would run it: as ``__main__``, with ``sys.argv`` set to
``[PROGRAM, *ARGS]`` and the program's folder first on ``sys.path``, in a working directory of its
own (``./<index>``, so two programs' relative checkpoint folders do not meet), and with Keras' global
state cleared in between. Why: starting a Keras process costs ~7 s of CPU, more than most of the
examples' training; the tests that run the examples under launched strategies (``phalanx run``,
TF_CONFIG workers, one device) therefore run one job per launcher instead of one per program: every
process runs the same plan, and the strategies that later programs create run on the same
processes, as they do in TF's tutorials, which create several strategies in one program.

Not for programs whose strategy starts its own replicas (``python train.py`` with a multi-replica
strategy): that self-launch restarts ``__main__``'s file, which is the program, not this plan.

The plan comes from the environment: ``PHALANX_TEST_PROGRAMS`` is a JSON list of
``[PROGRAM, ARG, ...]`` lists.

Each program's output is framed by ``<<< START <index>`` and ``<<< END <index>`` lines (see
``tests/conftest.py``'s ``program_outputs``), so that each test checks its own program's output and a
program that fails fails its own test by name. A failing program ends the job (its exception
propagates, as in a script of its own): the later programs do not run and their tests fail too.
"""

import faulthandler
import json
import os
import runpy
import signal
import sys

faulthandler.register(signal.SIGUSR1, all_threads=True)
PLAN = json.loads(os.environ["PHALANX_TEST_PROGRAMS"])
HOME = os.getcwd()
DRIVER_PATH0 = sys.path[0]

for index, (program, *args) in enumerate(PLAN):
    print(f"<<< START {index}", flush=True)
    workdir = os.path.join(HOME, str(index))
    os.makedirs(workdir, exist_ok=True)
    os.chdir(workdir)
    sys.argv = [program, *args]
    sys.path[0] = os.path.dirname(os.path.abspath(program))
    runpy.run_path(program, run_name="__main__")
    sys.path[0] = DRIVER_PATH0
    os.chdir(HOME)
    if "keras" in sys.modules:
        sys.modules["keras"].backend.clear_session()
    print(f"<<< END {index}", flush=True)
