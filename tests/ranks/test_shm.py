"""Multi-process tests of the shared-memory all-reduce (2 and 3 CPU ranks over Gloo, one host).

The backbone is equivalence: the same bits on every rank, and allclose to Gloo's all-reduce.
Failure tests check that a dead, stuck or mismatched peer becomes a typed error, never a hang.
"""

import multiprocessing as mp
import os
import queue as queue_module
import signal
import time

import pytest
import torch
import torch.distributed as dist

import phalanx
from phalanx.errors import CollectiveMismatchError, PeerFailedError, RanksTimedOutError
from phalanx.hooks import shm_allreduce_hook
from phalanx.shm import ShmCommunicator, shm_communicator
from phalanx.shm import communicator as shm_module
from phalanx.shm.segment import SHM_DIR, job_segments
from phalanx.testing import run_ranks

pytestmark = pytest.mark.skipif(not os.path.isdir(SHM_DIR), reason="needs /dev/shm")

SIZES = (0, 1, 5, 17, 1000, 100_003)
DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def _data(rank: int, numel: int, dtype: torch.dtype, salt: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(10_000 * rank + numel + salt)
    return torch.randn(numel, generator=generator).to(dtype)


def _gloo_average(tensor: torch.Tensor) -> torch.Tensor:
    expected = tensor.double().clone()  # .double() of a float64 tensor is the tensor itself
    dist.all_reduce(expected)
    return expected / dist.get_world_size()


def _exchange_everything(rank: int) -> dict:
    # staging_mb tiny: tensors larger than one page go through the slots in several rounds.
    comm = ShmCommunicator(staging_mb=0.01)
    other = ShmCommunicator()  # a second communicator on the same group keeps its own state
    results = {}
    for dtype in DTYPES:
        for numel in SIZES:
            tensor = _data(rank, numel, dtype)
            expected = _gloo_average(tensor)
            future = comm.allreduce_(tensor)
            results[("staged", dtype, numel)] = (future.wait(), expected)
    grid = _data(rank, 3 * 7 * 5, torch.float32).view(7, 15)[:, ::3]  # not contiguous
    results["strided"] = (other.allreduce_(grid, async_op=False).clone(), _gloo_average(grid))
    counts = torch.arange(10, dtype=torch.int64)
    expected = (counts * sum(range(1, dist.get_world_size() + 1))).double()
    results["int sum"] = (comm.allreduce_(counts * (rank + 1), average=False).wait(), expected)
    shared = other.alloc(100_003)
    for offset, numel in ((0, 100_003), (64, 999)):  # the whole allocation, and a slice of it
        piece = shared[offset:offset + numel]
        piece.copy_(_data(rank, numel, torch.float32, salt=offset))
        expected = _gloo_average(piece)
        results[("alloc", offset)] = (other.allreduce_(piece).wait().clone(), expected)
    other.release(shared)  # from now on an ordinary tensor: copied in and out
    shared.copy_(_data(rank, 100_003, torch.float32, salt=1))
    expected = _gloo_average(shared)
    results["released"] = (other.allreduce_(shared).wait().clone(), expected)

    class Bucket:  # what a DDP engine hands to a comm hook
        def buffer(self):
            return bucket_tensor

    bucket_tensor = _data(rank, 4099, torch.float32)
    expected = _gloo_average(bucket_tensor)
    results["hook"] = (shm_allreduce_hook(comm, Bucket()).wait(), expected)
    comm.close()
    other.close()
    return results


@pytest.mark.parametrize("world_size", [2, 3])
def test_same_bits_on_every_rank_and_close_to_gloo(world_size):
    """World sizes 2 and 3."""
    per_rank = run_ranks(_exchange_everything, world_size)
    for key, (result, expected) in per_rank[0].items():
        tolerance = 1e-2 if result.dtype in (torch.float16, torch.bfloat16) else 1e-6
        torch.testing.assert_close(result.double(), expected, rtol=tolerance, atol=tolerance, msg=str(key))
        for rank in range(1, world_size):
            assert torch.equal(per_rank[rank][key][0], result), f"rank {rank} differs on {key}"


# -- the posted exchange (DDP's default on 2 and 3 ranks) ---------------------------------------------

def _rank_order_sum(pieces: list[torch.Tensor]) -> torch.Tensor:
    """What gather_sum must give: the ranks' tensors added in rank order (half precision in fp32 beyond two)."""
    if len(pieces) > 2 and pieces[0].dtype in (torch.float16, torch.bfloat16):
        total = pieces[0].float()
        for piece in pieces[1:]:
            total += piece
        return total.to(pieces[0].dtype)
    total = pieces[0].clone()
    for piece in pieces[1:]:
        total = total + piece
    return total


def _posted_exchanges(rank: int) -> dict:
    world = dist.get_world_size()
    comm = ShmCommunicator(timeout=60.0)
    results = {}
    for dtype in DTYPES:
        shared = comm.alloc(10_007, dtype)
        for round_ in range(3):  # the same allocation again: claim() before rewriting it
            comm.claim(shared)
            shared.copy_(_data(rank, 10_007, dtype, salt=round_))
            piece = shared[64:64 + 9_001]  # a piece of the allocation, not at its start
            ticket = comm.post(piece)
            grid = torch.empty(300, 30, dtype=dtype).t()  # an output that is not contiguous
            tail = torch.empty(1, dtype=torch.float64)    # and one of a wider dtype
            comm.gather_sum(piece, ticket, [(0, grid), (9_000, tail)])
            everyone = [_data(j, 10_007, dtype, salt=round_)[64:64 + 9_001] for j in range(world)]
            expected = _rank_order_sum(everyone)
            results[(dtype, round_)] = (grid.reshape(-1).clone(), expected[:9_000],
                                        tail.item(), expected[9_000:].sum(dtype=torch.float64).item())
    comm.close()
    return results


@pytest.mark.parametrize("world_size", [2, 3])
def test_posted_exchange_gives_the_rank_order_sum_bitwise_on_every_rank(world_size):
    """World sizes 2 and 3."""
    per_rank = run_ranks(_posted_exchanges, world_size)
    for key, (grid, expected, tail, expected_tail) in per_rank[0].items():
        assert torch.equal(grid, expected), f"{key}: not the rank-order sum"
        assert tail == pytest.approx(expected_tail, rel=1e-2), key
        for rank in range(1, world_size):
            assert torch.equal(per_rank[rank][key][0], grid), f"rank {rank} differs on {key}"


def _split_exchanges(rank: int) -> dict:
    world = dist.get_world_size()
    comm = ShmCommunicator(timeout=60.0)
    results = {}
    for dtype in (torch.float32, torch.float64):
        shared = comm.alloc(10_007, dtype)
        bounds = comm.chunk_bounds(10_006, shared.element_size())  # the last element is summed plainly
        for round_ in range(3):
            grads = [_data(j, 10_007, dtype, salt=round_) for j in range(world)]  # every rank's, to check
            mine = grads[rank].clone()
            comm.claim(shared)
            shared.copy_(mine * 0.5)  # posted scaled (only the other ranks' chunks are read)
            ticket = comm.post(shared)
            lo, hi = bounds[rank], bounds[rank + 1]
            tag = torch.zeros(1, dtype=torch.float64)
            done = comm.reduce_own_chunk(shared, ticket, [(lo, mine[lo:hi])], 0.5, sums=[(10_006, tag)])
            comm.fetch_chunks(shared, done, [(j, bounds[j], mine[bounds[j]:bounds[j + 1]])
                                             for j in range(world) if j != rank])
            expected = _rank_order_sum([g * 0.5 for g in grads])
            results[(dtype, round_)] = (mine[:10_006], expected[:10_006], tag.item(), expected[10_006].item())
    comm.close()
    return results


@pytest.mark.parametrize("world_size", [pytest.param(2, marks=pytest.mark.smoke), 3])
def test_split_exchange_gives_the_rank_order_sum_bitwise_on_every_rank(world_size):
    """World sizes 2 and 3."""
    per_rank = run_ranks(_split_exchanges, world_size)
    for key, (result, expected, tag, expected_tag) in per_rank[0].items():
        assert torch.equal(result, expected), f"{key}: not the rank-order sum"
        assert tag == pytest.approx(expected_tag, rel=1e-6)
        for rank in range(1, world_size):
            assert torch.equal(per_rank[rank][key][0], result), f"rank {rank} differs on {key}"


def _fast_writer_and_slow_reader(rank: int) -> tuple:
    comm = ShmCommunicator(timeout=60.0)
    shared = comm.alloc(1000)
    shared.fill_(rank + 1.0)
    ticket = comm.post(shared)
    if rank == 1:
        time.sleep(0.5)  # rank 0 finishes its gather_sum and wants to rewrite its copy meanwhile
    total = torch.empty(1000)
    comm.gather_sum(shared, ticket, [(0, total)])
    started = time.monotonic()
    comm.claim(shared)  # rank 0: waits until rank 1 has read rank 0's copy
    waited = time.monotonic() - started
    shared.fill_(100.0)  # without the wait, this would land in rank 1's sum
    ticket = comm.post(shared)
    comm.gather_sum(shared, ticket, [(0, torch.empty(1000))])
    comm.close()
    return total.unique().tolist(), waited


def test_claim_keeps_a_fast_rank_from_overwriting_what_a_slow_rank_still_reads():
    """World size 2: rank 1 reads late."""
    (sum0, waited0), (sum1, waited1) = run_ranks(_fast_writer_and_slow_reader, 2)
    assert sum0 == sum1 == [3.0]
    assert waited0 > 0.3, "rank 0 rewrote its copy before rank 1 had read it"
    assert waited1 < 0.3


def _mismatched_and_missing_posts(rank: int) -> list:
    seen = []
    lonely = ShmCommunicator(timeout=1.0)
    shared = lonely.alloc(100)
    if rank == 0:  # rank 1 never posts
        try:
            lonely.gather_sum(shared, lonely.post(shared), [(0, torch.empty(100))])
        except RanksTimedOutError as exc:
            seen.append(("timeout", exc.missing_ranks))
    dist.barrier()
    comm = ShmCommunicator(timeout=30.0)
    shared = comm.alloc(100)
    piece = shared[:90 + rank]  # the ranks post different pieces
    try:
        comm.gather_sum(piece, comm.post(piece), [(0, torch.empty(90))])
    except CollectiveMismatchError as exc:
        seen.append(("mismatch", exc.peer_rank))
    try:
        comm.post(shared)
    except CollectiveMismatchError:
        seen.append(("still failed",))
    try:
        comm.post(torch.zeros(100))
    except TypeError:
        seen.append(("not allocated",))
    return seen


def test_posted_exchange_fails_on_every_rank_when_posts_differ_or_a_rank_never_posts():
    """World size 2."""
    seen = run_ranks(_mismatched_and_missing_posts, 2)
    assert seen[0] == [("timeout", [1]), ("mismatch", 1), ("still failed",), ("not allocated",)]
    assert seen[1] == [("mismatch", 0), ("still failed",), ("not allocated",)]


def _phalanx_ddp_with_a_hook_on_another_communicator(rank: int) -> dict:
    results = {}
    for registered in (False, True):
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(33, 300), torch.nn.ReLU(), torch.nn.Linear(300, 5))
        model = phalanx.DistributedDataParallel(net)
        if registered:  # a hook on a communicator of the user's: it is called, with torch's contract
            model.register_comm_hook(ShmCommunicator(), shm_allreduce_hook)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        generator = torch.Generator().manual_seed(rank)
        for _ in range(3):
            optimizer.zero_grad()
            model(torch.randn(8, 33, generator=generator)).square().mean().backward()
            optimizer.step()
        results[registered] = (type(model._reducer.exchange).__name__,
                               torch.cat([p.detach().flatten() for p in net.parameters()]))
    return results


def test_phalanx_ddp_calls_a_shm_hook_whose_communicator_did_not_allocate_its_buckets():
    """World size 2."""
    for per_rank in run_ranks(_phalanx_ddp_with_a_hook_on_another_communicator, 2):
        (default_exchange, default), (hook_exchange, hooked) = per_rank[False], per_rank[True]
        assert (default_exchange, hook_exchange) == ("ShmExchange", "CommHookExchange")
        torch.testing.assert_close(hooked, default, rtol=1e-6, atol=1e-7)


def _train_torch_ddp(rank: int, steps: int) -> list:
    # torch's own DDP, once with its default all-reduce and once with our hook: same training.
    results = []
    comm = ShmCommunicator()
    for use_hook in (False, True):
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(33, 64), torch.nn.ReLU(), torch.nn.Linear(64, 5))
        model = torch.nn.parallel.DistributedDataParallel(net, bucket_cap_mb=0.01)  # several buckets
        if use_hook:
            model.register_comm_hook(comm, shm_allreduce_hook)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        generator = torch.Generator().manual_seed(rank)
        for _ in range(steps):
            optimizer.zero_grad()
            model(torch.randn(8, 33, generator=generator)).square().mean().backward()
            optimizer.step()
        results.append(torch.cat([p.detach().flatten() for p in net.parameters()]))
    comm.close()
    return results


def test_torch_ddp_with_the_shm_hook_trains_like_its_default_all_reduce():
    """World size 2."""
    (default_0, hooked_0), (default_1, hooked_1) = run_ranks(_train_torch_ddp, 2, args=(5,))
    torch.testing.assert_close(hooked_0, default_0)
    assert torch.equal(hooked_0, hooked_1) and torch.equal(default_0, default_1)


def _back_to_back_with_a_slow_rank(rank: int, rounds: int) -> list:
    comm = ShmCommunicator(staging_mb=0.05)
    shared = comm.alloc(50_000)
    world = dist.get_world_size()
    wrong = []
    for step in range(rounds):
        if rank == 1 and step % 3 == 0:
            time.sleep(0.003)  # the slow rank: a fast peer must not overwrite what it still reads
        # Many ops in flight at once, staged and in shared memory, launched before any wait.
        staged = [torch.full((n,), float(rank + step + i)) for i, n in enumerate((10, 30_000, 7))]
        shared.fill_(float(rank * step))
        futures = [comm.allreduce_(t) for t in staged] + [comm.allreduce_(shared)]
        for future in futures:
            future.wait()
        for i, tensor in enumerate(staged):
            if not torch.all(tensor == sum(r + step + i for r in range(world)) / world):
                wrong.append((step, i))
        if not torch.all(shared == sum(r * step for r in range(world)) / world):
            wrong.append((step, "shared"))
    comm.close()
    return wrong


@pytest.mark.parametrize("world_size", [2, 3])
def test_back_to_back_async_ops_with_a_slow_rank(world_size):
    """World sizes 2 and 3: rank 1 is the slow one."""
    assert run_ranks(_back_to_back_with_a_slow_rank, world_size, args=(60,)) == [[]] * world_size


def _stuck_and_mismatched_peers(rank: int) -> list:
    seen = []
    stuck = ShmCommunicator(timeout=1.0)
    if rank == 0:  # rank 1 never joins this all-reduce
        try:
            stuck.allreduce_(torch.ones(10), async_op=False)
        except RanksTimedOutError as exc:
            seen.append(("timeout", exc.missing_ranks))
    dist.barrier()
    mismatched = ShmCommunicator(timeout=30.0)
    try:
        mismatched.allreduce_(torch.ones(10 + rank)).wait()
    except CollectiveMismatchError as exc:
        seen.append(("mismatch", exc.peer_rank))
    try:  # after a failure the communicator stays failed instead of exchanging garbage
        mismatched.allreduce_(torch.ones(10)).wait()
    except CollectiveMismatchError:
        seen.append(("still failed",))
    try:
        stuck.alloc(100 + rank)
    except CollectiveMismatchError:
        seen.append(("alloc mismatch",))
    return seen


def test_stuck_peer_times_out_and_mismatched_sizes_or_allocs_fail_on_every_rank():
    """World size 2."""
    seen = run_ranks(_stuck_and_mismatched_peers, 2)
    assert seen[0] == [("timeout", [1]), ("mismatch", 1), ("still failed",), ("alloc mismatch",)]
    assert seen[1] == [("mismatch", 0), ("still failed",), ("alloc mismatch",)]


GAVE_UP_TIMEOUT = 60.0  # the communicators' own: what a wait for a rank that gave the exchange up would last


def _close_in_flight(rank: int) -> dict:
    """Ranks 0 and 1 start an all-reduce that rank 2 (alive) never joins, as the ranks left do after a loss; rank 1
    then closes its communicator (the engine rebuilt on the ranks left) while the all-reduce is in flight."""
    comm = ShmCommunicator(timeout=GAVE_UP_TIMEOUT)
    seen: dict = {}
    dist.barrier()
    started = time.monotonic()
    if rank == 0:
        try:
            comm.allreduce_(torch.ones(10)).wait()
            seen["outcome"] = "finished"
        except PeerFailedError:
            seen["outcome"] = "PeerFailedError"
        seen["ended_after"] = time.monotonic() - started
    elif rank == 1:
        comm.allreduce_(torch.ones(10))
        time.sleep(0.5)  # in flight: waiting on rank 2
        comm.close()
        seen["closed_after"] = time.monotonic() - started
    seen["group_held"] = comm.group is not None if rank == 1 else None
    dist.barrier()  # rank 2 stays alive until the others are done
    comm.close()
    return seen


def test_closing_a_communicator_ends_its_peers_wait_on_an_all_reduce_the_ranks_gave_up():
    """World size 3. Closed with an all-reduce in flight, a communicator gives it up: its peer's wait ends at once
    (PeerFailedError) instead of at the timeout, its own worker stops, and it lets its process group go."""
    seen = run_ranks(_close_in_flight, 3, timeout=3 * GAVE_UP_TIMEOUT)
    assert seen[0]["outcome"] == "PeerFailedError", seen
    assert seen[0]["ended_after"] < GAVE_UP_TIMEOUT / 4, seen
    assert seen[1]["closed_after"] < GAVE_UP_TIMEOUT / 4, seen
    assert seen[1]["group_held"] is False, seen


def _factory_decisions(rank: int) -> list:
    decisions = [shm_communicator() is not None]
    if rank == 1:
        os.environ["PHALANX_SHM"] = "0"
    decisions.append(shm_communicator() is not None)  # off on one rank: off on all, and nobody hangs
    return decisions


def test_factory_respects_phalanx_shm_zero_on_any_rank():
    """World size 2: PHALANX_SHM=0 on rank 1 only."""
    assert run_ranks(_factory_decisions, 2) == [[True, False], [True, False]]


# -- a rank SIGKILLed mid-exchange ------------------------------------------------------------------
# phalanx.testing stops every rank as soon as one dies; here the survivor must keep running to
# report what it saw, so these ranks are started by hand.

def _kill_self_midway(parts, average, scratch):
    os.kill(os.getpid(), signal.SIGKILL)


def _victim_or_survivor(rank: int, world: int, port: int, results, posted: bool) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), PHALANX_STORE_HOSTED="1",
                      PHALANX_BACKEND="gloo", OMP_NUM_THREADS="1")
    phalanx.init()
    comm = ShmCommunicator(timeout=120.0)
    comm.allreduce_(torch.ones(1000), async_op=False)
    shared = comm.alloc(100_000)
    if posted:  # one good posted exchange, then the victim dies before its next post
        comm.gather_sum(shared, comm.post(shared), [(0, torch.empty(100_000))])
        if rank == world - 1:
            os.kill(os.getpid(), signal.SIGKILL)
    elif rank == world - 1:
        shm_module.reduce_chunk = _kill_self_midway  # dies after arriving, before finishing its chunk
    started = time.monotonic()
    try:
        if posted:
            comm.claim(shared)
            comm.gather_sum(shared, comm.post(shared), [(0, torch.empty(100_000))])
        else:
            comm.allreduce_(torch.ones(100_000)).wait()
        outcome = "no error"
    except PeerFailedError as exc:
        outcome = type(exc).__name__
    results.put((rank, outcome, time.monotonic() - started, comm.segment_names))
    # Leave without phalanx.shutdown(): its farewell barrier would wait a minute for the dead rank.
    results.close()
    results.join_thread()
    os._exit(0)


@pytest.mark.parametrize("posted", [False, True], ids=["two-phase", "posted"])
@pytest.mark.parametrize("world_size", [2, 3])
def test_a_rank_killed_mid_exchange_fails_the_others_and_leaves_no_segment(world_size, posted):
    """World sizes 2 and 3, ranks started by hand: the last rank is SIGKILLed."""
    server = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False)
    context = mp.get_context("forkserver")  # ranks fork from a server that imported torch once
    results = context.Queue()
    ranks = [context.Process(target=_victim_or_survivor, args=(r, world_size, server.port, results, posted))
             for r in range(world_size)]
    for process in ranks:
        process.start()
    reports = []
    try:
        deadline = time.monotonic() + 100  # below the communicator's 120 s: a timeout would not count
        while len(reports) < world_size - 1 and time.monotonic() < deadline:
            try:
                reports.append(results.get(timeout=0.5))
            except queue_module.Empty:
                if all(process.exitcode is not None for process in ranks):
                    break
        if len(reports) < world_size - 1:
            pytest.fail(f"only {len(reports)} of {world_size - 1} survivors reported: {reports}")
    finally:
        for process in ranks:
            process.join(30)
            if process.is_alive():
                process.kill()
                process.join()
    assert ranks[-1].exitcode == -signal.SIGKILL
    # Every survivor waits on the dead rank and names it, well before the 120 s timeout.
    assert sorted(outcome for _, outcome, _, _ in reports) == ["PeerDiedError"] * (world_size - 1)
    for name in reports[0][3]:
        assert job_segments(name) == []
