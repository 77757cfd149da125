"""ShardGather with real FSDP2: two processes, gloo over a loopback TCPStore, a model sharded
with `fully_shard`; every gather written into a buffer, and every one sent through a real weight
channel, equals `full_tensor()` bit for bit; one rank sending to two receivers while the other
only drains (a tensor-parallel rollout group) runs the same gathers on both.

The test process hosts the store (port 0: the kernel picks a free one); each rank runs in a
spawned process, joined with a deadline and killed on failure.
"""

from __future__ import annotations

import multiprocessing
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch._C._distributed_c10d import TCPStore  # torch.distributed re-exports it untyped

from timeshare.engines.fsdp.gather import ShardGather, lent_parameters
from timeshare.errors import TransferError
from timeshare.protocols.weights import (
    LentTensor,
    TransferConfig,
    WeightReceiver,
    WeightSender,
    weight_endpoint,
)

WORLD = 2
RANK_DEADLINE_S = 120.0  # both ranks, from start to exit (spawning imports torch)
COLLECTIVE_TIMEOUT = timedelta(seconds=60)
# Rows: 5 and 7 shard unevenly (3+2, 4+3), 64 evenly, 301 past a bucket, 1 leaves rank 1 empty.
LAYERS = [(3, 5), (5, 7), (7, 64), (64, 301), (301, 1)]
BUCKET_MB = 1 / 16  # 64 KiB: the 301x64 fp32 weight (77 KB) is materialized and cut


# -- inside each rank ------------------------------------------------------------------------


def sharded_model() -> torch.nn.Sequential:
    """The same model on every rank (same seed), sharded per layer and at the root."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(i, o) for i, o in LAYERS))
    mesh = init_device_mesh("cpu", (WORLD,))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def full_tensors(
    model: torch.nn.Module, dtype: torch.dtype | None = None
) -> dict[str, torch.Tensor]:
    """Every parameter gathered the usual way: what the gathers must equal."""
    from torch.distributed.tensor import DTensor

    full: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            assert isinstance(parameter, DTensor), name
            tensor = parameter.full_tensor()
            full[name] = tensor if dtype is None else tensor.to(dtype)
    return full


def assert_identical(got: torch.Tensor, want: torch.Tensor, name: str) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape, (name, got.shape, want.shape)
    got_bytes = got.contiguous().reshape(-1).view(torch.uint8)
    assert torch.equal(got_bytes, want.contiguous().reshape(-1).view(torch.uint8)), name


def check_written_into_buffers(model: torch.nn.Module, dtype: torch.dtype | None) -> None:
    """Each ShardGather written into a buffer: the tensor, then nothing past its scratch."""
    want = full_tensors(model, dtype)
    items = list(lent_parameters(model, dtype=dtype, timeout_s=60.0))
    assert [name for name, _ in items] == list(want)
    for name, item in items:
        assert isinstance(item, ShardGather), name
        assert item.scratch_bytes >= item.nbytes
        buffer = torch.full((item.scratch_bytes + 64,), 0xAB, dtype=torch.uint8)
        item.write_into(buffer[: item.scratch_bytes])
        written = buffer[: item.nbytes].view(item.dtype).view(item.shape)
        assert_identical(written, want[name], name)
        assert bool((buffer[item.scratch_bytes :] == 0xAB).all()), f"{name} wrote past its scratch"
        assert_identical(item.materialize(), want[name], name)


def check_refuses_other_shardings() -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    mesh = init_device_mesh("cpu", (WORLD,))
    replicated = distribute_tensor(torch.ones(4, 2), mesh, [Replicate()])
    try:
        ShardGather(replicated, name="rep")
    except TransferError as exc:
        assert "'rep': sharded (Replicate(),)" in str(exc), str(exc)
    else:
        raise AssertionError("a replicated DTensor was accepted")


def check_sent_through_the_channel(model: torch.nn.Module, runtime_dir: Path, rank: int) -> None:
    """Each rank sends lent_parameters to its own receiver (a thread), twice, checksummed."""
    import anyio

    config = TransferConfig(bucket_mb=BUCKET_MB, checksum=True, ack_timeout_s=60.0)
    url = weight_endpoint(runtime_dir, rank)
    want = full_tensors(model, torch.bfloat16)
    got: dict[str, torch.Tensor] = {}

    def receive() -> None:
        with WeightReceiver(url, config) as receiver:
            for _ in range(2):
                receiver.receive(lambda items: got.update((n, t.clone()) for n, t in items))

    async def send() -> None:
        with WeightSender(url, config) as sender:
            for version in (0, 1):
                items = lent_parameters(model, dtype=torch.bfloat16, timeout_s=60.0)
                report = await sender.send(items, version=version)
                assert report.tensors == len(want) and report.checksummed == report.buckets

    thread = threading.Thread(target=receive)
    thread.start()
    try:
        anyio.run(send)
    finally:
        thread.join(timeout=60)
    assert not thread.is_alive(), "the receiver did not finish"
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert_identical(got[name], tensor, name)


def check_one_sends_for_the_group(model: torch.nn.Module, runtime_dir: Path, rank: int) -> None:
    """A tensor-parallel rollout group of both ranks: rank 0 sends to the engine's two workers
    (two receivers, threads here), rank 1 only drains (outlet.drain): their gathers pair up,
    materialized ones included, and both digest the same weights."""
    import anyio

    from timeshare.engines.digest import WeightsDigest
    from timeshare.engines.outlet import digested, drain

    config = TransferConfig(bucket_mb=BUCKET_MB, checksum=True, ack_timeout_s=60.0)
    url = weight_endpoint(runtime_dir, 0)
    want = full_tensors(model, torch.bfloat16)
    digest = WeightsDigest()
    if rank == 1:
        tensors, nbytes = drain(
            lent_parameters(model, dtype=torch.bfloat16, timeout_s=60.0),
            digest,
            config.bucket_bytes,
        )
        assert (tensors, nbytes) == (len(want), sum(t.nbytes for t in want.values()))
    else:
        got: list[dict[str, torch.Tensor]] = [{}, {}]

        def receive(member: int) -> None:
            with WeightReceiver(url, config, member=member, members=2) as receiver:
                receiver.receive(lambda items: got[member].update((n, t.clone()) for n, t in items))

        async def send() -> None:
            with WeightSender(url, config, receivers=2) as sender:
                items = lent_parameters(model, dtype=torch.bfloat16, timeout_s=60.0)
                await sender.send(digested(items, digest), version=0)

        threads = [threading.Thread(target=receive, args=(k,)) for k in range(2)]
        for thread in threads:
            thread.start()
        try:
            anyio.run(send)
        finally:
            for thread in threads:
                thread.join(timeout=60)
        for member in range(2):
            assert sorted(got[member]) == sorted(want)
            for name, tensor in want.items():
                assert_identical(got[member][name], tensor, name)
    digests = [None, None]
    dist.all_gather_object(digests, digest.hexdigest())
    assert digests[0] == digests[1], digests


def run_rank(rank: int, port: int, check: str, runtime_dir: str) -> None:
    """One rank's process: join the group through the test's store, run `check`, leave."""
    torch.set_num_threads(1)
    store = TCPStore("127.0.0.1", port, is_master=False, timeout=COLLECTIVE_TIMEOUT)
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=WORLD, timeout=COLLECTIVE_TIMEOUT
    )
    try:
        model = sharded_model()
        if check == "buffers":
            check_written_into_buffers(model, None)
            check_written_into_buffers(model, torch.bfloat16)
            check_refuses_other_shardings()
        elif check == "group":
            check_one_sends_for_the_group(model, Path(runtime_dir), rank)
        else:
            check_sent_through_the_channel(model, Path(runtime_dir), rank)
        dist.barrier()  # neither leaves while the other may still need it
    finally:
        dist.destroy_process_group()


# -- the test process ------------------------------------------------------------------------


@pytest.fixture
def store_port() -> Iterator[int]:
    """A loopback TCPStore the ranks join; the kernel picks its port."""
    store = TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=COLLECTIVE_TIMEOUT
    )
    yield store.port
    del store


def run_ranks(target: Callable[..., None], *args: Any) -> None:
    """Run `target(rank, *args)` in WORLD spawned processes; each must exit 0 by the deadline.

    On a failure or past the deadline every rank still running is killed (one stuck in a
    collective would wait for the dead one until the process group's timeout)."""
    context = multiprocessing.get_context("spawn")
    procs = [context.Process(target=target, args=(rank, *args)) for rank in range(WORLD)]
    for proc in procs:
        proc.start()
    deadline = time.monotonic() + RANK_DEADLINE_S
    try:
        while any(p.exitcode is None for p in procs) and time.monotonic() < deadline:
            if any(p.exitcode not in (None, 0) for p in procs):
                break  # one failed: the other would only wait for it
            time.sleep(0.05)
        codes = [p.exitcode for p in procs]
        assert codes == [0] * WORLD, f"rank exit codes {codes} (None: still running at the end)"
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
            proc.join(timeout=10)


@pytest.mark.slow
def test_every_gather_written_into_a_buffer_equals_full_tensor(store_port: int) -> None:
    run_ranks(run_rank, store_port, "buffers", "")


@pytest.mark.slow
def test_lent_parameters_sent_through_the_channel_equal_full_tensor(
    store_port: int, runtime_dir: Path
) -> None:
    run_ranks(run_rank, store_port, "channel", str(runtime_dir))


@pytest.mark.slow
def test_a_rank_that_sends_nothing_runs_the_senders_gathers_in_step(
    store_port: int, runtime_dir: Path
) -> None:
    run_ranks(run_rank, store_port, "group", str(runtime_dir))


def test_an_unsharded_module_lends_its_parameters_as_detached_tensors() -> None:
    model = torch.nn.Linear(3, 2)
    items = dict(lent_parameters(model, dtype=torch.bfloat16))
    assert list(items) == ["weight", "bias"]
    for name, item in items.items():
        assert not isinstance(item, LentTensor)
        assert not item.requires_grad and item.dtype == torch.bfloat16
        assert torch.equal(item, getattr(model, name).detach().bfloat16())
    weight = dict(lent_parameters(model))["weight"]
    assert isinstance(weight, torch.Tensor)
    assert weight.data_ptr() == model.weight.data_ptr()  # no copy when no cast
