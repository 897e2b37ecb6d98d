"""What the conformance tests share: the jobs that run a suite's cases, and the differences list.

One job per (suite, strategy) runs every case of the suite on every process (``runner.py``); a case
that broke the communicator or a process ends the job, and the next job starts after it. Each
(case, strategy) pair is then one test that asserts on that job's records (:func:`check`).
"""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path
from typing import Callable

import pytest

from tf_conformance import registry
from tf_conformance.runner import load_cases

from conftest import free_ports, run_job, run_jobs, tf_config

RUNNER = Path(__file__).parent / "runner.py"
DIFFERENCES = Path(__file__).parent.parent / "data" / "tf_distribute_differences.txt"
PORTING = Path(__file__).parent.parent.parent / "docs" / "porting.md"  # the README links it
# A case that raised on one replica while the other waits in a collective costs this long.
COLLECTIVE_TIMEOUT = 15
JOB_TIMEOUT = {"tf": 240, "keras": 420}  # one job (all cases); a restart after a broken case starts a new job
MAX_JOBS = 12  # a strategy's jobs, restarts included


def listed_differences() -> dict[str, str]:
    """``<case id>[<strategy>]`` (or ``[*]``) -> reason, from the differences file's conformance section."""
    text = DIFFERENCES.read_text()
    _, found, section = text.partition("# conformance")
    out = {}
    for line in section.splitlines()[1:] if found else []:
        line = line.strip()
        if line and not line.startswith("#"):
            key, _, reason = line.partition(": ")
            out[key.strip().removeprefix("conformance/")] = reason.strip()
    return out


def listed_reason(case_id: str, strategy: str) -> str | None:
    diffs = listed_differences()
    return diffs.get(f"{case_id}[{strategy}]") or diffs.get(f"{case_id}[*]")


def pairs(cases: list) -> list:
    """Every (case, strategy) the cases run under."""
    return [(c, s) for c in cases for s in c.strategies]


def _env() -> dict[str, str]:
    return {
        "KERAS_BACKEND": "torch",
        "OMP_NUM_THREADS": "1",
        "PHALANX_COLLECTIVE_TIMEOUT": str(COLLECTIVE_TIMEOUT),
    }


def _run_once(suite: str, name: str, out: Path, start: int, attempt: int) -> None:
    cmd = [sys.executable, str(RUNNER), name, str(out), str(start), str(attempt), suite]
    cwd = out / f"job_{attempt}"
    cwd.mkdir()
    if name == registry.MULTI_WORKER:
        workers = [f"127.0.0.1:{p}" for p in free_ports(2)]
        jobs = [(cmd, {**_env(), **tf_config(workers, i)}) for i in range(2)]
        run_jobs(jobs, timeout=JOB_TIMEOUT[suite], cwd=cwd)
    else:
        run_job(cmd, timeout=JOB_TIMEOUT[suite], cwd=cwd, env=_env())


def run_strategy(suite: str, name: str, out: Path) -> dict[str, list[dict]]:
    """Runs every case of ``suite`` under ``name``; returns case id -> each process's record."""
    cases = load_cases(suite)
    world = 1 if name == registry.ONE_DEVICE else 2
    start = 0
    for attempt in range(MAX_JOBS):
        _run_once(suite, name, out, start, attempt)
        if all((out / f"done_{r}").exists() for r in range(world)):
            break
        # The job stopped early: go on after the case it stopped at (recorded or not).
        current = [int(p.read_text()) for p in out.glob("current_*")]
        if not current:
            pytest.fail(f"{name}: the job ran no case; see {out}/job_{attempt}")
        stopped = max(current)
        for r in range(world):
            path = out / f"results_{r}.jsonl"
            seen = {json.loads(ln)["idx"] for ln in path.read_text().splitlines()} if path.exists() else set()
            if stopped not in seen:
                with open(path, "a") as f:
                    f.write(
                        json.dumps(
                            {
                                "idx": stopped,
                                "id": cases[stopped].id,
                                "rank": r,
                                "status": "error",
                                "text": f"the process did not finish this case (hang or crash); logs in {out}",
                            }
                        )
                        + "\n"
                    )
        start = stopped + 1
    else:
        pytest.fail(f"{name}: {MAX_JOBS} jobs did not get through the cases; see {out}")
    records: dict[str, list[dict]] = {}
    for r in range(world):
        for line in (out / f"results_{r}.jsonl").read_text().splitlines():
            rec = json.loads(line)
            records.setdefault(rec["id"], []).append(rec)
    return records


def outcomes_fixture(suite: str, tmp_path_factory) -> Callable[[str], dict[str, list[dict]]]:
    """strategy -> case id -> records; each strategy's job runs on first use."""
    done: dict[str, dict] = {}

    def get(name: str) -> dict[str, list[dict]]:
        if name not in done:
            began = time.monotonic()
            done[name] = run_strategy(suite, name, tmp_path_factory.mktemp(f"conf_{suite}_{name}"))
            seconds = sum(r.get("seconds", 0.0) for recs in done[name].values() for r in recs if r["rank"] == 0)
            print(f"\nconformance {suite} {name}: {time.monotonic() - began:.1f}s (cases: {seconds:.1f}s)")
        return done[name]

    return get


def check(records: list[dict] | None, case, strategy: str) -> None:
    """Fails unless the case passed on every process, or failed where it is a listed difference."""
    assert records, f"{case.id} was not run under {strategy}"
    bad = [r for r in records if r["status"] != "passed"]
    reason = listed_reason(case.id, strategy)
    if reason is not None:
        assert bad, (
            f"{case.id} under {strategy} is listed as a difference ({reason}) but passes: remove it from the list"
        )
        return
    if bad:
        lines = [f"TF: {case.source}"]
        for r in bad:
            lines.append(f"replica {r['rank']}: {r['status']}: {r['text']}")
            if r.get("tb"):
                lines.append(r["tb"])
        pytest.fail("\n".join(lines), pytrace=False)


def counts(cases: list, strategy: str) -> tuple[int, int]:
    """(runs not listed as differences, runs) of ``cases`` under ``strategy``."""
    runs = [c for c, s in pairs(cases) if s == strategy]
    listed = [c for c in runs if listed_reason(c.id, strategy) is not None]
    return len(runs) - len(listed), len(runs)


def named_in_porting(cases: list) -> list[str]:
    """Listed cases of ``cases`` that docs/porting.md does not name (in backquotes)."""
    ids = {c.id for c in cases}
    named = set(re.findall(r"`([\w.]+)`", PORTING.read_text()))
    return sorted({k.split("[")[0] for k in listed_differences()} & ids - named)
