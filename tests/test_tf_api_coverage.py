"""Every public ``tf.distribute`` name of TF 2.21 exists in phalanx, or is a documented difference.

The names are in tests/data/tf_distribute_names.txt (written from TF's API reference; TensorFlow
is not needed); the differences, each with its reason, in tests/data/tf_distribute_differences.txt,
and the porting page (docs/porting.md, linked from the README) names each of them.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import phalanx

DATA = Path(__file__).parent / "data"
PORTING = Path(__file__).parent.parent / "docs" / "porting.md"


def _lines(name: str) -> list[str]:
    return [ln.strip() for ln in (DATA / name).read_text().splitlines() if ln.strip() and not ln.startswith("#")]


def tf_names() -> list[str]:
    return _lines("tf_distribute_names.txt")


def differences() -> dict[str, str]:
    out = {}
    # The file's "# conformance" section lists conformance cases (tests/tf_conformance), not names.
    text = (DATA / "tf_distribute_differences.txt").read_text().split("\n# conformance\n", 1)[0]
    for line in (ln.strip() for ln in text.splitlines() if ln.strip() and not ln.startswith("#")):
        name, _, reason = line.partition(":")
        out[name.strip()] = reason.strip()
    return out


def resolve(name: str) -> object:
    """``phalanx.<name>``, attribute by attribute; raises AttributeError when absent."""
    obj: object = phalanx
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj


def present(name: str) -> bool:
    try:
        resolve(name)
        return True
    except AttributeError:
        return False


def test_names_list_is_tf_2_21_sized():
    names = tf_names()
    assert len(names) == len(set(names)), "a name is listed twice"
    assert len(names) >= 130


@pytest.mark.parametrize("name", tf_names())
def test_tf_name_present_or_documented(name):
    diffs = differences()
    if name in diffs:
        assert diffs[name], f"{name}: the documented difference gives no reason"
        return
    assert present(name), f"phalanx.{name} is missing and tests/data/tf_distribute_differences.txt does not say why"


def test_documented_differences_are_real_and_in_readme():
    names, diffs = set(tf_names()), differences()
    assert set(diffs) <= names, f"differences for names TF does not have: {set(diffs) - names}"
    stale = [n for n in diffs if present(n) and not diffs[n].startswith("present;")]
    assert not stale, (
        f"present now, so not missing: {stale} (start the reason with 'present;' for a behaviour difference)"
    )
    porting = PORTING.read_text()
    missing = [n for n in diffs if f"`{n}`" not in porting]
    assert not missing, f"docs/porting.md's table does not name: {missing}"


def test_coverage_count():
    """The number reported on the porting page (present / listed)."""
    names = tf_names()
    have = sum(present(n) for n in names)
    text = PORTING.read_text()
    assert f"{have} of {len(names)}" in text, f"docs/porting.md should state the coverage: {have} of {len(names)}"


def test_tpu_names_raise_a_typed_error_where_no_tpu_exists():
    """Issue 16 (the distributed training guide): TF's TPU snippet, renamed, fails with a typed
    error naming the device and what to use instead, not an AttributeError."""
    from phalanx.errors import InvalidDeviceError

    for make in (
        lambda: phalanx.cluster_resolver.TPUClusterResolver(tpu="grpc://10.0.0.2:8470"),
        lambda: phalanx.TPUStrategy(None),
        lambda: phalanx.experimental.TPUStrategy(),
    ):
        with pytest.raises(InvalidDeviceError, match="TPU") as info:
            make()
        assert info.value.device == "TPU" and "MirroredStrategy" in info.value.hint
