"""TF's tf.distribute tests, translated, under the four synchronous CPU strategies (issue 28).

One job per strategy (tests/tf_conformance/runner.py) runs every case on every process; each
(case, strategy) pair is one test here, asserting on that job's records. A case listed in the
"# conformance" section of tests/data/tf_distribute_differences.txt is a reasoned difference: it
must fail (a listed case that passes is reported, so the list stays true). The Keras suite
(tf_keras/distribute's tests) is tests/tf_conformance/keras/, run the same way.
"""

from __future__ import annotations

import pytest

from tf_conformance import harness, registry
from tf_conformance.runner import load_cases

CASES = load_cases("tf")
KERAS_CASES = load_cases("keras")
PAIRS = harness.pairs(CASES)


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    """strategy -> case id -> records; each strategy's job runs on first use."""
    return harness.outcomes_fixture("tf", tmp_path_factory)


@pytest.mark.parametrize(("case", "strategy"), PAIRS, ids=[f"{c.id}-{s}" for c, s in PAIRS])
def test_case(outcomes, case, strategy):
    harness.check(outcomes(strategy).get(case.id), case, strategy)


def test_listed_differences_name_real_cases():
    every = CASES + KERAS_CASES
    known = {f"{c.id}[{s}]" for c, s in harness.pairs(every)} | {f"{c.id}[*]" for c in every}
    stale = [k for k in harness.listed_differences() if k not in known]
    assert not stale, f"tf_distribute_differences.txt lists conformance cases that do not exist: {stale}"
    assert all(harness.listed_differences().values()), "a listed conformance difference gives no reason"


@pytest.mark.parametrize("suite", registry.SUITES)
def test_the_readme_gives_each_strategys_count(suite):
    # "(223 of 228)": the cases a strategy runs, less those listed as differences for it.
    porting = harness.PORTING.read_text()
    cases = load_cases(suite)
    for strategy in registry.ALL:
        passing, runs = harness.counts(cases, strategy)
        count = f"({passing} of {runs})"
        assert count in porting, f"docs/porting.md should give {strategy}'s count of the {suite} suite: {count}"


def test_the_whole_suite_passes_98_percent_of_its_runs_per_strategy():
    for strategy in registry.ALL:
        passing, runs = harness.counts(CASES + KERAS_CASES, strategy)
        assert passing >= 0.98 * runs, f"{strategy}: {passing} of {runs} runs pass ({passing / runs:.1%})"


def test_the_readme_shows_the_listed_differences():
    missing = harness.named_in_porting(CASES + KERAS_CASES)
    assert not missing, f"docs/porting.md does not name these listed conformance cases: {missing}"


def test_enough_cases():
    assert len(CASES) >= 150, len(CASES)
    assert len(KERAS_CASES) >= 150, len(KERAS_CASES)
    assert all(c.source.split()[0].endswith(".py") and len(c.source.split()) >= 2 for c in CASES + KERAS_CASES)
