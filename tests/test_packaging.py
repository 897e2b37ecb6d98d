"""The dependency ranges CI tests are the ones the metadata declares, at both ends.

``.ci/run`` installs into fresh virtual environments: once with the newest versions a fresh
install gets, once with ``.ci/constraints-oldest.txt``. That file is only honest if each of its
pins is the lower bound phalanx's metadata (``pyproject.toml``) allows, and if the environment the tests run in keeps
to the declared ranges; both are checked here (in each job, against what that job installed).
"""

from __future__ import annotations

import re
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
CONSTRAINTS = ROOT / ".ci" / "constraints-oldest.txt"


def _requirements() -> list[Requirement]:
    """Every requirement of phalanx's metadata as installed (extras included): pyproject.toml's."""
    return [Requirement(spec) for spec in metadata.requires("phalanx") or []]


def _lower_bounds() -> dict[str, Version]:
    bounds: dict[str, Version] = {}
    for req in _requirements():
        for spec in req.specifier:
            if spec.operator == ">=":
                name = req.name.lower().replace("_", "-")
                bounds[name] = max(bounds.get(name, Version(spec.version)), Version(spec.version))
    return bounds


def _pins() -> dict[str, str]:
    pins = {}
    for line in CONSTRAINTS.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, version = re.fullmatch(r"([A-Za-z0-9_.-]+)==(\S+)", line).groups()
            pins[name.lower().replace("_", "-")] = version
    return pins


def test_each_oldest_pin_is_the_metadata_lower_bound():
    bounds, pins = _lower_bounds(), _pins()
    assert pins, "the constraints file pins nothing"
    for name, version in pins.items():
        assert name in bounds, (
            f"{name} is pinned in {CONSTRAINTS.name} but phalanx's installed metadata gives it no lower bound "
            "(pyproject.toml changed? reinstall)"
        )
        assert Version(version) == bounds[name], (
            f"{CONSTRAINTS.name} pins {name}=={version}, but pyproject.toml's lower bound is {bounds[name]}: "
            "move one to the other"
        )


def test_the_notebook_repl_keras_tracker_and_progress_floors_are_all_pinned():
    pins = _pins()
    for name in (
        "keras",
        "numpy",
        "ipython",
        "ipykernel",
        "nbclient",
        "nbformat",
        "pexpect",
        "mlflow-skinny",
        "wandb",
        "tqdm",
        "rich",
    ):
        assert name in pins, f"{name}'s lower bound is not tested: pin it in {CONSTRAINTS.name}"


@pytest.mark.parametrize(
    "name",
    [
        "torch",
        "numpy",
        "keras",
        "ipython",
        "ipykernel",
        "nbclient",
        "nbformat",
        "mlflow-skinny",
        "wandb",
        "tqdm",
        "rich",
    ],
)
def test_this_environment_keeps_to_the_declared_ranges(name):
    version = Version(metadata.version(name))
    for req in _requirements():
        if req.name.lower() == name:
            assert req.specifier.contains(version, prereleases=True), f"{name} {version} is outside {req}"


def test_ci_installs_into_fresh_virtual_environments():
    ci = (ROOT / ".ci" / "run").read_text()
    assert ci.count("python3 -m venv") >= 2, "CI must not test the machine's own Python"
    assert f"-c .ci/{CONSTRAINTS.name}" in ci


def test_the_oldest_versions_job_runs_the_tracker_and_progress_tests():
    ci = (ROOT / ".ci" / "run").read_text()
    oldest = ci[ci.index("job 2") :]
    for test in ("tests/test_trackers.py", "tests/test_watch_unit.py", "tests/test_watch_job.py"):
        assert test in oldest, f"{test} exercises the extras' clients: run it at their oldest versions too"
