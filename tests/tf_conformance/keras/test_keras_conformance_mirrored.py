"""tf_keras/distribute's tests, translated, under MirroredStrategy (two CPU replicas); OneDevice and
MultiWorkerMirrored are in test_keras_conformance.py, whose docstring says how the suite runs,
CentralStorage in test_keras_conformance_central_storage.py. Apart so that a worker of CI's
``--dist loadfile`` takes each file (each strategy's job is minutes long).
"""

from __future__ import annotations

import pytest

from tf_conformance import harness, registry
from tf_conformance.runner import load_cases

CASES = load_cases("keras")
HERE = (registry.MIRRORED,)
PAIRS = [(c, s) for c, s in harness.pairs(CASES) if s in HERE]


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    """strategy -> case id -> records; each strategy's job runs on first use."""
    return harness.outcomes_fixture("keras", tmp_path_factory)


@pytest.mark.parametrize(("case", "strategy"), PAIRS, ids=[f"{c.id}-{s}" for c, s in PAIRS])
def test_case(outcomes, case, strategy):
    harness.check(outcomes(strategy).get(case.id), case, strategy)
