"""phalanx.keras without processes: version gate, optional import, callback selection."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

# Keras reads its backend once, at its first import (which test_callback_selection may do).
os.environ.setdefault("KERAS_BACKEND", "torch")

from phalanx.keras._version import UnsupportedKerasError, check_keras_version, parse_version


@pytest.mark.parametrize("version", ["3.6.0", "3.10.0", "3.15.1", "3.15.0.dev2025"])
def test_supported_versions(version):
    check_keras_version(version, "torch")


@pytest.mark.parametrize("version", ["2.15.0", "3.5.0", "3.16.0", "4.0.0", "nightly"])
def test_unsupported_versions_fail_clearly(version):
    with pytest.raises(UnsupportedKerasError, match=r"Keras >=3\.6,<3\.16|Cannot read the Keras version") as e:
        check_keras_version(version, "torch")
    assert version in str(e.value) and "HINT" in str(e.value)
    assert isinstance(e.value, ImportError)


def test_other_backends_fail_clearly():
    with pytest.raises(UnsupportedKerasError, match="torch backend.*'jax'"):
        check_keras_version("3.15.1", "jax")


def test_parse_version():
    assert parse_version("3.15.1") == (3, 15)


def test_core_never_imports_keras():
    code = "import sys, phalanx; assert 'keras' not in sys.modules, sorted(m for m in sys.modules if 'keras' in m)"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_importing_phalanx_keras_first_selects_the_torch_backend():
    code = "import phalanx.keras, keras; assert keras.backend.backend() == 'torch', keras.backend.backend()"
    env = {k: v for k, v in os.environ.items() if k != "KERAS_BACKEND"}
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=60)


def test_callback_selection():
    keras = pytest.importorskip("keras")
    from phalanx.keras import callbacks as cbs

    checkpoint = keras.callbacks.ModelCheckpoint("x.weights.h5", save_weights_only=True)
    early = keras.callbacks.EarlyStopping()
    history = keras.callbacks.History()
    everything = [checkpoint, early, history, keras.callbacks.CSVLogger("log.csv")]
    assert cbs.for_replica(everything, is_chief=True) == everything
    assert cbs.for_replica(everything, is_chief=False) == [early, history]
    assert not cbs.may_stop_mid_epoch(everything)
    assert cbs.may_stop_mid_epoch([keras.callbacks.TerminateOnNaN()])
    assert cbs.may_stop_mid_epoch([keras.callbacks.LambdaCallback(on_train_batch_end=lambda b, logs: None)])
    assert not cbs.may_stop_mid_epoch([keras.callbacks.LambdaCallback(on_epoch_end=lambda e, logs: None)])
