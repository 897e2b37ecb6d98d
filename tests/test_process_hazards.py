"""Lines every replica runs that behave differently when every replica is a process (issue 50).

``os.makedirs(d)`` without ``exist_ok`` races between the replicas (all but the first raise
``FileExistsError``) and ``input()`` asks on every replica: phalanx warns once per line
(``ProcessHazardWarning``, naming the line), on a job of several processes only; the safe idioms
and library code do not warn. docs/porting.md lists these hazards with their idioms.
"""

from __future__ import annotations

import json
import sys

from conftest import run_job

BODY = """
import io, json, os, sys, warnings
from pathlib import Path
import phalanx as px
from phalanx.core.hazards import ProcessHazardWarning

out = Path(sys.argv[1])
strategy = px.OneDeviceStrategy("cpu") if sys.argv[2] == "one" else px.MirroredStrategy(["cpu:0", "cpu:1"])
rank = px.process_index()
root = out / "dirs"
seen = []
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    os.makedirs(root / "shared" / "a", exist_ok=True)               # safe
    Path(root, "shared", "b").mkdir(parents=True, exist_ok=True)    # safe
    for _ in range(2):
        os.makedirs(root / f"own_{rank}_{_}" / "x")                  # unsafe: the same line twice
    Path(root, f"path_{rank}").mkdir()                              # unsafe
    os.mkdir(root / f"plain_{rank}")                                # unsafe
    sys.stdin = io.StringIO("yes\\n")
    answer = input()                                                # unsafe
    import tempfile
    tempfile.mkdtemp()                                              # a library's: not the program's
    seen = [(w.category.__name__, os.path.basename(w.filename), w.lineno, str(w.message)) for w in caught
            if issubclass(w.category, ProcessHazardWarning)]
(out / f"seen_{rank}.json").write_text(json.dumps(seen))
strategy.close()
"""


def _seen(tmp_path, script, mode):
    path = script(BODY, name=f"hazards_{mode}.py")
    out = tmp_path / mode
    out.mkdir()
    res = run_job([sys.executable, str(path), str(out), mode], timeout=120, cwd=tmp_path, env={"OMP_NUM_THREADS": "1"})
    assert res.returncode == 0, res.logs()[-4000:]
    return [json.loads(p.read_text()) for p in sorted(out.glob("seen_*.json"))], path


def test_hazards_are_warned_once_per_line_on_every_replica(tmp_path, script):
    seen, path = _seen(tmp_path, script, "mirrored")
    lines = path.read_text().splitlines()
    assert len(seen) == 2
    for replica in seen:
        flagged = [lines[lineno - 1].strip() for _, name, lineno, _ in replica if name == path.name]
        assert [line.split("#")[0].strip() for line in flagged] == [
            'os.makedirs(root / f"own_{rank}_{_}" / "x")',
            'Path(root, f"path_{rank}").mkdir()',
            'os.mkdir(root / f"plain_{rank}")',
            "answer = input()",
        ], replica
        assert "exist_ok=True" in replica[0][3] and "FileExistsError" in replica[0][3]
        assert "is_chief" in replica[3][3]


def test_one_process_is_not_warned(tmp_path, script):
    seen, _ = _seen(tmp_path, script, "one")
    assert seen == [[]]
