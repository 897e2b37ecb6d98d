"""The consistency guard's device path, checked on the CPU: what it writes into a bucket equals what
it encodes on the host, its fingerprint is exact and sensitive, and nothing depends on chunking.

On a GPU the same code writes from pinned memory and computes the fingerprint on the device
(tests/test_gpu.py and ``benchmarks/gpu/syncs.py`` check that no host wait results); here the
bfloat16 buckets take the staged path, and float32 ones the in-place numpy path.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from phalanx.comm import guard as guard_module
from phalanx.comm.guard import FIELDS, FieldGuard, ReplicaGuard, digits_for, fingerprint_tensor


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rank", [0, 2])
def test_write_puts_in_the_bucket_what_encode_returns(dtype, rank):
    fields = FieldGuard(rank, 3)
    values = (123456, 256, 7, 0xABCDEF)
    bucket = torch.full((5 + fields.size(dtype),), 9.0, dtype=dtype)
    tail = bucket[5:]
    for _ in range(3):  # the staged path takes its two buffers in turn
        fields.write(values, tail)
        assert torch.equal(tail, fields.encode(values, dtype)), (dtype, tail)
    assert torch.equal(bucket[:5], torch.full((5,), 9.0, dtype=dtype)), "only the guard's room is written"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_value_placed_on_the_device_reads_back_as_the_encoded_field(dtype):
    fields = FieldGuard(1, 2)
    tail = torch.zeros(fields.size(dtype), dtype=dtype)
    fields.write((5, 32, 5, 0), tail)
    fields.place(FIELDS.index("parameters"), torch.tensor(0x12AB34), tail)
    assert torch.equal(tail, fields.encode((5, 32, 5, 0x12AB34), dtype))
    assert fields.decode(tail) == [[0, 0, 0, 0], [5, 32, 5, 0x12AB34]]


def test_the_fingerprint_is_exact_and_sees_one_bit_a_swap_and_a_swapped_tensor():
    torch.manual_seed(0)
    params = [torch.randn(4, 5), torch.randn(5), torch.randn(5).to(torch.bfloat16)]
    base = int(fingerprint_tensor(params))
    assert 1 <= base < 2**24
    assert int(fingerprint_tensor([p.clone() for p in params])) == base

    flipped = [p.clone() for p in params]
    flipped[0].view(torch.int32)[1, 2] ^= 1  # one bit of one float
    assert int(fingerprint_tensor(flipped)) != base

    swapped = [p.clone() for p in params]
    swapped[0][0, 0], swapped[0][0, 1] = params[0][0, 1], params[0][0, 0]
    assert int(fingerprint_tensor(swapped)) != base

    a, b = torch.randn(5), torch.randn(5)
    assert int(fingerprint_tensor([a, b])) != int(fingerprint_tensor([b, a]))  # one shape, another order
    reordered = [params[0], params[2], params[1]]  # another order of dtypes: summed apart, told by layout
    assert int(fingerprint_tensor(reordered)) != base


def test_the_fingerprint_does_not_depend_on_its_chunks(monkeypatch):
    torch.manual_seed(1)
    params = [torch.randn(37, 11), torch.randn(101)]
    whole = int(fingerprint_tensor(params))
    monkeypatch.setattr(guard_module, "_CHUNK", 16)
    assert int(fingerprint_tensor(params)) == whole


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_guard_writes_its_fields_and_fingerprint_as_it_encodes_them(dtype):
    step = [1]
    comm = SimpleNamespace(rank=1, world_size=2, name=lambda r: f"replica:{r}")
    params = [("w", torch.arange(6.0)), ("b", torch.ones(2))]
    by_write = ReplicaGuard(comm, lambda: (step[0], 8, step[0]), lambda: params, every=2)
    by_encode = ReplicaGuard(comm, lambda: (step[0], 8, step[0]), lambda: params, every=2)
    tail = torch.zeros(by_write.size(dtype), dtype=dtype)
    assert by_write.size(dtype) == 2 * len(FIELDS) * digits_for(dtype)
    carried = []
    for step[0] in range(1, 6):
        by_write.write_into(tail)
        expected = by_encode.encode(dtype)
        assert torch.equal(tail, expected), (step[0], tail, expected)
        carried.append(FieldGuard(1, 2).decode(tail)[1][FIELDS.index("parameters")] != 0)
    assert carried == [True, False, True, False, True]  # the first step, then every 2


def test_on_a_gpu_the_fields_ride_every_eighth_pass_and_a_restore_at_once():
    """On a GPU a check costs two copies between host and device (100-300 us of host time on an
    H200): the fields ride every GUARD_EVERY_GPU-th pass, the first included, and a pass after a
    restore (a fingerprint due) at once. On a CPU every pass. Only the device's type is read here."""
    from phalanx.config import GUARD_EVERY_GPU

    comm = SimpleNamespace(rank=0, world_size=2, name=lambda r: f"replica:{r}")
    guard = ReplicaGuard(comm, lambda: (1, 8, 1), lambda: [("w", torch.ones(3))])
    guard.fingerprint_due = False
    gpu = [p for p in range(1, 3 * GUARD_EVERY_GPU + 1) if guard.rides(torch.device("cuda", 0))]
    assert GUARD_EVERY_GPU > 1 and gpu == [1, 1 + GUARD_EVERY_GPU, 1 + 2 * GUARD_EVERY_GPU]
    guard.fingerprint_due = True  # mark_parameters_changed(): every replica marks it at the same point
    assert guard.rides(torch.device("cuda", 0))
    cpu = ReplicaGuard(comm, lambda: (1, 8, 1), lambda: [("w", torch.ones(3))])
    assert all(cpu.rides(torch.device("cpu")) for _ in range(10))
    # A pass that does not ride zeros the room (its sum is not read), one that rides writes the fields.
    three = ReplicaGuard(comm, lambda: (4, 8, 2), lambda: [("w", torch.ones(3))], check_every=3)
    three.fingerprint_due = False
    tail = torch.full((three.size(torch.float32),), 7.0)
    assert [three.ride(tail) for _ in range(4)] == [True, False, False, True]
    assert tail.tolist() == FieldGuard(0, 2).encode((4, 8, 2, 0), torch.float32).tolist()
    assert not three.ride(tail) and not tail.any()


def test_guard_every_checks_every_nth_pass_of_a_real_process_group(monkeypatch, tmp_path):
    """PHALANX_GUARD_EVERY=3 (a GPU's cadence, set on a CPU): a world-size-1 Mirrored job with its
    process group checks passes 1, 4, 7 and 10 of ten; by default (a CPU) every pass."""
    import phalanx as px

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))  # torch's optimizer import sets it otherwise
    monkeypatch.setenv("PHALANX_SINGLE_REPLICA_COLLECTIVES", "1")
    checks = {}
    for every in ("3", None):
        if every is None:
            monkeypatch.delenv("PHALANX_GUARD_EVERY")
        else:
            monkeypatch.setenv("PHALANX_GUARD_EVERY", every)
        strategy = px.MirroredStrategy(["cpu"])
        try:
            with strategy.scope():
                model = torch.nn.Linear(4, 1)
                opt = torch.optim.SGD(model.parameters(), lr=0.1)

            def step(model=model, opt=opt):
                opt.zero_grad()
                px.nn.compute_average_loss(model(torch.ones(2, 4)).sum(1)).backward()
                opt.step()

            for _ in range(10):
                strategy.run(step)
            strategy.extended.check_consistency()
            checks[every] = strategy.extended.consistency.checks
        finally:
            strategy.close()
    assert checks == {"3": 4, None: 10}
