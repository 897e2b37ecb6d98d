"""tf_keras/distribute's tests, translated, under the four synchronous CPU strategies (issue 50):
OneDevice and MultiWorkerMirrored here, Mirrored and CentralStorage in test_keras_conformance_mirrored.py
and test_keras_conformance_central_storage.py.

As tests/tf_conformance/test_conformance.py does for TF's tf.distribute tests: one job per strategy
(``runner.py STRATEGY OUT 0 0 keras``) runs every case of the Keras suite on every process; each
(case, strategy) pair is one test here. A case listed in the "# conformance" section of
tests/data/tf_distribute_differences.txt must fail.
"""

from __future__ import annotations

import pytest

from tf_conformance import harness, registry
from tf_conformance.runner import load_cases

CASES = load_cases("keras")
# Two strategies here (the shorter jobs), the other two in a file each: CI's --dist loadfile gives
# each file to one worker, so the suite's four jobs run in parallel with the rest of the suite.
HERE = (registry.ONE_DEVICE, registry.MULTI_WORKER)
PAIRS = [(c, s) for c, s in harness.pairs(CASES) if s in HERE]


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    """strategy -> case id -> records; each strategy's job runs on first use."""
    return harness.outcomes_fixture("keras", tmp_path_factory)


@pytest.mark.parametrize(("case", "strategy"), PAIRS, ids=[f"{c.id}-{s}" for c, s in PAIRS])
def test_case(outcomes, case, strategy):
    harness.check(outcomes(strategy).get(case.id), case, strategy)


def test_every_case_cites_a_tf_keras_test():
    sources = {c.source.split()[0] for c in CASES}
    assert all(s.endswith("_test.py") for s in sources), sorted(sources)
