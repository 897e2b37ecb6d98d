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
