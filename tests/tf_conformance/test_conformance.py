"""TF's tf.distribute tests, translated, under the four synchronous CPU strategies (issue 28).

One job per strategy (tests/tf_conformance/runner.py) runs every case on every process; each
(case, strategy) pair is one test here, asserting on that job's records. A case listed in the
"# conformance" section of tests/data/tf_distribute_differences.txt is a reasoned difference: it
must fail (a listed case that passes is reported, so the list stays true).
"""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path

import pytest

from tf_conformance import registry
from tf_conformance.runner import load_cases

from conftest import free_ports, run_job, run_jobs, tf_config

RUNNER = Path(__file__).parent / "runner.py"
DIFFERENCES = Path(__file__).parent.parent / "data" / "tf_distribute_differences.txt"
PORTING = Path(__file__).parent.parent.parent / "docs" / "porting.md"  # the README links it
CASES = load_cases()
# A case that raised on one replica while the other waits in a collective costs this long.
COLLECTIVE_TIMEOUT = 15
JOB_TIMEOUT = 240  # one job (all cases); a restart after a broken case starts a new job
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


def _env() -> dict[str, str]:
    return {
        "KERAS_BACKEND": "torch",
        "OMP_NUM_THREADS": "1",
        "PHALANX_COLLECTIVE_TIMEOUT": str(COLLECTIVE_TIMEOUT),
    }


def _run_once(name: str, out: Path, start: int, attempt: int) -> None:
    cmd = [sys.executable, str(RUNNER), name, str(out), str(start), str(attempt)]
    cwd = out / f"job_{attempt}"
    cwd.mkdir()
    if name == registry.MULTI_WORKER:
        workers = [f"127.0.0.1:{p}" for p in free_ports(2)]
        jobs = [(cmd, {**_env(), **tf_config(workers, i)}) for i in range(2)]
        run_jobs(jobs, timeout=JOB_TIMEOUT, cwd=cwd)
    else:
        run_job(cmd, timeout=JOB_TIMEOUT, cwd=cwd, env=_env())


def run_strategy(name: str, out: Path) -> dict[str, list[dict]]:
    """Runs every case under ``name``; returns case id -> each process's record."""
    world = 1 if name == registry.ONE_DEVICE else 2
    start, logs = 0, []
    for attempt in range(MAX_JOBS):
        _run_once(name, out, start, attempt)
        logs.append(attempt)
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
                                "id": CASES[stopped].id,
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


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    """strategy -> case id -> records; each strategy's job runs on first use."""
    done: dict[str, dict] = {}

    def get(name: str) -> dict[str, list[dict]]:
        if name not in done:
            began = time.monotonic()
            done[name] = run_strategy(name, tmp_path_factory.mktemp(f"conf_{name}"))
            print(f"\nconformance {name}: {time.monotonic() - began:.1f}s")
        return done[name]

    return get


PAIRS = [(c, s) for c in CASES for s in c.strategies]


@pytest.mark.parametrize(("case", "strategy"), PAIRS, ids=[f"{c.id}-{s}" for c, s in PAIRS])
def test_case(outcomes, case, strategy):
    records = outcomes(strategy).get(case.id)
    assert records, f"{case.id} was not run under {strategy}"
    bad = [r for r in records if r["status"] != "passed"]
    diffs = listed_differences()
    reason = diffs.get(f"{case.id}[{strategy}]") or diffs.get(f"{case.id}[*]")
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


def test_listed_differences_name_real_cases():
    known = {f"{c.id}[{s}]" for c, s in PAIRS} | {f"{c.id}[*]" for c in CASES}
    stale = [k for k in listed_differences() if k not in known]
    assert not stale, f"tf_distribute_differences.txt lists conformance cases that do not exist: {stale}"
    assert all(listed_differences().values()), "a listed conformance difference gives no reason"


def test_the_readme_gives_each_strategys_count():
    # "(223 of 228)": the cases a strategy runs, less those listed as differences for it.
    porting = PORTING.read_text()
    diffs = listed_differences()
    for strategy in registry.ALL:
        runs = [c for c, s in PAIRS if s == strategy]
        listed = [c for c in runs if f"{c.id}[{strategy}]" in diffs or f"{c.id}[*]" in diffs]
        count = f"({len(runs) - len(listed)} of {len(runs)})"
        assert count in porting, f"docs/porting.md should give {strategy}'s count: {count}"


def test_the_readme_shows_the_listed_differences():
    porting = PORTING.read_text()
    missing = sorted({k.split("[")[0] for k in listed_differences()} - set(re.findall(r"`([\w.]+)`", porting)))
    assert not missing, f"docs/porting.md does not name these listed conformance cases: {missing}"


def test_enough_cases():
    assert len(CASES) >= 150, len(CASES)
    assert all(c.source.split()[0].endswith(".py") and len(c.source.split()) >= 2 for c in CASES)
