"""The GPU paths' jobs on CPU replicas, so that CI (which has no GPU) runs the same code.

tests/test_gpu.py runs them on a GPU: one replica with its process group built anyway (NCCL
there, gloo here) and two replica processes sharing one device over gloo. Here the guard is read
at once (CPU tensors), so a divergence is named at the step it happened.
"""

from __future__ import annotations

from gpu_paths import check_shared_device, check_single_replica_collectives


def test_single_replica_builds_its_process_group_when_asked(tmp_path):
    check_single_replica_collectives(tmp_path, backend="gloo", device="cpu")


def test_two_replicas_on_one_device_equal_one_device_and_name_a_divergence(tmp_path):
    check_shared_device(tmp_path, device="cpu", late_by=0)
