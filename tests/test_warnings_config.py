"""The pytest configuration's warning filters: third-party deprecations are quiet, ours fail the run."""

from __future__ import annotations

import warnings

import pytest


@pytest.mark.parametrize("category", [DeprecationWarning, PendingDeprecationWarning, FutureWarning])
def test_a_deprecation_in_phalanx_fails(category):
    with pytest.raises(category, match="old phalanx call"):
        # As Python attributes a deprecated call made from phalanx's code (stacklevel 2).
        warnings.warn_explicit("old phalanx call", category, "phalanx/devices.py", 1, module="phalanx.devices")


@pytest.mark.parametrize("module", ["keras.src.backend", "torch.distributed", "numpy.core"])
@pytest.mark.parametrize("category", [DeprecationWarning, PendingDeprecationWarning, FutureWarning])
def test_a_third_party_deprecation_is_filtered(module, category):
    with warnings.catch_warnings(record=True) as seen:  # keeps the configured filters
        warnings.warn_explicit("old third-party call", category, f"{module}.py", 7, module=module)
    assert seen == []


def test_other_warnings_still_show():
    with warnings.catch_warnings(record=True) as seen:
        warnings.warn_explicit("a user warning", UserWarning, "keras/x.py", 3, module="keras.x")
    assert [str(w.message) for w in seen] == ["a user warning"]
