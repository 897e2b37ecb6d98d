"""The Communicator protocol and its error translation, without processes."""

from __future__ import annotations

import sys

import pytest
import torch
import torch.distributed as dist

from phalanx.comm.communicator import Communicator, LocalCommunicator, classify
from phalanx.comm.cross_device_ops import NcclAllReduce, ReductionToOneDevice
from phalanx.comm.group_communicator import ProcessGroupCommunicator
from phalanx.comm.threaded import ThreadedWorld, run_threaded
from phalanx.errors import CollectiveTimeoutError, PeerUnavailableError


def test_every_communicator_implements_the_protocol():
    assert isinstance(LocalCommunicator(), Communicator)
    assert isinstance(ThreadedWorld(2).communicator(0), Communicator)
    for name in (
        "all_reduce",
        "reduce",
        "broadcast",
        "all_gather",
        "barrier",
        "name",
        "host_of",
        "subgroup",
        "errors_for",
        "close",
        "store",
    ):
        assert hasattr(ProcessGroupCommunicator, name), name


@pytest.mark.parametrize(
    "error,kind",
    [
        (dist.DistNetworkError("Connection reset by peer"), PeerUnavailableError),
        (dist.DistStoreError("wait timeout after 5000ms"), CollectiveTimeoutError),
        (dist.DistBackendError("[Gloo] Timed out waiting 5000ms for recv operation"), CollectiveTimeoutError),
        (dist.DistBackendError("[Gloo] Connection closed by peer [127.0.0.1]:1234"), PeerUnavailableError),
        (TimeoutError("whatever the text"), CollectiveTimeoutError),
        # The type decides before the text: a network error that mentions a timeout is still a lost peer.
        (dist.DistNetworkError("socket timed out after the peer closed it"), PeerUnavailableError),
    ],
)
def test_errors_are_classified_by_type_first(error, kind):
    assert classify(error) is kind


@pytest.mark.parametrize("ops", [NcclAllReduce(), ReductionToOneDevice()])
def test_cross_device_ops_over_threads(ops):
    def body(comm):
        t = torch.full((5,), float(comm.rank + 1))
        return ops.all_reduce(comm, t, "sum").wait().tolist()

    assert run_threaded(3, body) == [[6.0] * 5] * 3


def test_a_missing_rank_is_a_collective_timeout_on_the_others():
    def body(comm):
        if comm.rank == 0:
            return "left"
        comm.all_reduce(torch.ones(1)).wait()

    world_errors = []

    def wrapped(comm):
        try:
            return body(comm)
        except CollectiveTimeoutError as e:
            world_errors.append(e)

    run_threaded(2, wrapped, collective_timeout=0.5)
    assert len(world_errors) == 1


def test_calls_of_different_steps_that_do_not_match_are_a_step_divergence():
    # Pure logic: the typed error of the shared-memory transport (tested with processes in
    # test_shm_allreduce.py) becomes the divergence it shows; end to end in test_consistency.py.
    from phalanx.comm.communicator import GroupSpec
    from phalanx.errors import CollectiveMismatchError, ReplicaDivergenceError

    comm = object.__new__(ProcessGroupCommunicator)
    comm.spec = GroupSpec(rank=1, world_size=2, master_addr="127.0.0.1", master_port=1, bind_addr="127.0.0.1")
    comm._host_ranks = [0, 1]
    bucket, barrier = {"numel": 101_778, "dtype": "float32", "op": "sum"}, {"numel": 8, "dtype": "int64", "op": "sum"}
    behind = CollectiveMismatchError("shm all_reduce", 1, [{**bucket, "tag": 2}, {**barrier, "tag": 3}])
    error = comm._out_of_step(behind)
    assert isinstance(error, ReplicaDivergenceError)
    assert (error.field, error.values, error.step) == ("step", (2, 3), 2)
    assert error.replicas == ("replica:0 (rank 0)", "replica:1 (rank 1)")
    assert "step is 2 on replica:0 (rank 0) but 3 on replica:1 (rank 1)" in str(error)
    # Same step, different tensors: not a divergence of steps; the mismatch stays as it is.
    assert (
        comm._out_of_step(CollectiveMismatchError("shm all_reduce", 1, [{**bucket, "tag": 2}, {**barrier, "tag": 2}]))
        is None
    )


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="SIOCGIFADDR is Linux's")
def test_interface_of_names_the_interface_holding_an_address():
    """torch's default group (FSDP2's) takes its gloo interface from this: loopback's is lo."""
    from phalanx.comm.process_group import interface_of

    assert interface_of("127.0.0.1") == "lo"
    assert interface_of("203.0.113.77") is None  # TEST-NET-3: on no interface here
