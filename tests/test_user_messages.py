"""Messages a user reads: an absent device, a distributed value's repr (in process and under 2 replicas)."""

from __future__ import annotations

import json
import sys

import pytest
import torch

import phalanx as px
from phalanx.errors import DeviceNotFoundError, DuplicateDeviceError, InvalidDeviceError

from conftest import run_job


@pytest.mark.parametrize("name", ["gpu:7", "/gpu:7", "cuda:7", "/job:localhost/replica:0/task:0/device:GPU:7"])
def test_absent_gpu_is_not_present_rather_than_unknown(name):
    """On this host (whatever it has) GPU 7 + its count is absent: the error says so and fits the host."""
    gpus = torch.cuda.device_count()
    absent = name.replace("7", str(gpus + 7))
    with pytest.raises(DeviceNotFoundError) as e:
        px.OneDeviceStrategy(absent)
    assert isinstance(e.value, InvalidDeviceError)  # existing handlers keep working
    text = str(e.value)
    assert text.startswith(f"Device {absent!r} is not present"), text
    assert "Unknown" not in text and e.value.available == gpus
    if gpus == 0:
        assert "no visible GPU" in text and "'cpu:0'" in e.value.hint and "/gpu:" not in e.value.hint
    else:
        assert f"'/gpu:{gpus - 1}'" in e.value.hint or gpus == 1


@pytest.mark.parametrize(
    "gpus,expected,unexpected",
    [
        (0, ["this host has no visible GPU", "'cpu'", "CUDA_VISIBLE_DEVICES"], ["/gpu:", "cuda:0"]),
        (1, ["this host has 1 visible GPU(s)", "'/gpu:0'", "'cuda:0'"], ["/gpu:1", "..", "'cpu:0'"]),
        (2, ["this host has 2 visible GPU(s)", "'/gpu:0'..'/gpu:1'", "'cuda:0'..'cuda:1'"], ["'cpu:0'"]),
    ],
)
def test_absent_gpu_hint_fits_the_host(monkeypatch, gpus, expected, unexpected):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    with pytest.raises(DeviceNotFoundError) as e:
        px.OneDeviceStrategy("/gpu:5")
    for text in expected:
        assert text in str(e.value), str(e.value)
    for text in unexpected:
        assert text not in e.value.hint, e.value.hint


def test_malformed_device_is_still_unknown():
    with pytest.raises(InvalidDeviceError, match="Unknown device 'tpu:0'") as e:
        px.OneDeviceStrategy("tpu:0")
    assert not isinstance(e.value, DeviceNotFoundError)


@pytest.mark.parametrize(
    "make,devices,duplicate,what",
    [
        (px.MirroredStrategy, ["cpu:0", "cpu:0"], "'cpu:0'", "devices"),
        (px.MirroredStrategy, ["cpu:0", "cpu:1", "/cpu:1"], "'/cpu:1' (the same as 'cpu:1')", "devices"),
        (lambda d: px.CentralStorageStrategy(compute_devices=d), ["cpu:1", "cpu:1"], "'cpu:1'", "compute_devices"),
    ],
)
def test_duplicate_device_is_called_a_duplicate(make, devices, duplicate, what):
    """The device is known, it is repeated: the message said "Unknown device ['cpu:0', 'cpu:0']"."""
    with pytest.raises(DuplicateDeviceError) as e:
        make(devices)
    assert isinstance(e.value, InvalidDeviceError)  # existing handlers keep working
    assert str(e.value) == (
        f"Duplicate device {duplicate} in {what} {devices!r}. HINT: each device may appear once in {what}"
    )


def test_per_replica_repr_in_one_process():
    assert repr(px.PerReplica((1.5, 2.5))) == "PerReplica({0: 1.5, 1: 2.5})"
    assert repr(px.Mirrored((3,))) == "Mirrored({0: 3})"
    held = px.PerReplica((1.5,), replica_ids=(1,), num_replicas=2)
    assert repr(held) == "PerReplica(local replicas {1: 1.5} of 2)"


def test_per_replica_repr_and_is_chief_under_two_replicas(tmp_path):
    """repr says which replicas are local; is_chief() outside scope() is true in replica 0 only."""
    script = tmp_path / "repr_job.py"
    script.write_text(
        "import json, phalanx as px, torch\n"
        "strategy = px.MirroredStrategy(['cpu:0', 'cpu:1'])\n"
        "value = strategy.run(lambda: torch.tensor(1.5) + px.get_replica_context().replica_id_in_sync_group)\n"
        "rank = strategy.extended.process_index\n"
        "json.dump({'repr': repr(value), 'chief': px.is_chief()}, open(f'repr_{rank}.json', 'w'))\n"
    )
    result = run_job([sys.executable, str(script)], timeout=120, cwd=tmp_path)
    assert result.returncode == 0, result.logs()
    zero, one = (json.loads((tmp_path / f"repr_{r}.json").read_text()) for r in range(2))
    assert zero == {"repr": "PerReplica(local replicas {0: tensor(1.5000)} of 2)", "chief": True}
    assert one == {"repr": "PerReplica(local replicas {1: tensor(2.5000)} of 2)", "chief": False}
