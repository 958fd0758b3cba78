"""Single-process unit tests of the DDP building blocks (no process group needed)."""

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

import phalanx
from phalanx.bucket.buckets import Bucket, GradBucket, plan_buckets
from phalanx.bucket.step_guard import tag_modulus
from phalanx.engine.torch_surface import move_to
from phalanx.errors import WorldConfigError

MB = 2 ** 20


def test_plan_follows_the_given_order_with_a_small_first_bucket():
    params = [torch.zeros(MB // 4) for _ in range(4)]  # 1 MiB each
    assert plan_buckets(params, [3, 2, 1, 0], cap_bytes=2 * MB, first_cap_bytes=MB) == [[3], [2, 1], [0]]


def test_plan_gives_an_oversized_tensor_its_own_bucket():
    params = [torch.zeros(10), torch.zeros(3 * MB // 4), torch.zeros(10)]
    assert plan_buckets(params, [2, 1, 0], cap_bytes=MB, first_cap_bytes=MB) == [[2], [1], [0]]


def test_plan_separates_dtypes_and_orders_buckets_by_first_gradient():
    params = [torch.zeros(4), torch.zeros(4, dtype=torch.float64), torch.zeros(4), torch.zeros(4, dtype=torch.float64)]
    assert plan_buckets(params, [3, 2, 1, 0], cap_bytes=MB) == [[3, 1], [2, 0]]


def test_plan_separates_devices():
    # 'meta' tensors stand in for a second device: the plan only reads device, dtype and size.
    params = [torch.zeros(4), torch.zeros(4, device="meta"), torch.zeros(4), torch.zeros(4, device="meta")]
    assert plan_buckets(params, [3, 2, 1, 0], cap_bytes=MB) == [[3, 1], [2, 0]]


@settings(max_examples=60, deadline=None)
@given(sizes=st.lists(st.tuples(st.integers(1, 3000), st.booleans()), min_size=1, max_size=30),
       cap=st.integers(64, 20000), first=st.integers(64, 20000), seed=st.integers(0, 1000))
def test_plan_covers_each_parameter_once_within_caps(sizes, cap, first, seed):
    params = [torch.zeros(n, dtype=torch.float64 if wide else torch.float32) for n, wide in sizes]
    order = torch.randperm(len(params), generator=torch.Generator().manual_seed(seed)).tolist()
    plan = plan_buckets(params, order, cap_bytes=cap, first_cap_bytes=first)
    assert sorted(i for bucket in plan for i in bucket) == list(range(len(params)))
    position = {index: pos for pos, index in enumerate(order)}
    for bucket in plan:
        assert len({params[i].dtype for i in bucket}) == 1
        assert [position[i] for i in bucket] == sorted(position[i] for i in bucket), "a bucket keeps the ready order"
        nbytes = sum(params[i].numel() * params[i].element_size() for i in bucket)
        assert nbytes <= max(cap, first) or len(bucket) == 1
    firsts = [position[bucket[0]] for bucket in plan]
    assert firsts == sorted(firsts)


def _bucket(index: int, indices: list[int], params: list, as_view: bool = False) -> Bucket:
    storage = torch.zeros(Bucket.storage_numel(indices, params), dtype=params[indices[0]].dtype)
    return Bucket(index, indices, params, storage, as_view)


def test_bucket_views_alias_one_flat_buffer_with_a_tag_slot():
    params = [torch.nn.Parameter(torch.randn(2, 3)), torch.nn.Parameter(torch.randn(4))]
    bucket = _bucket(0, [1, 0], params)
    assert bucket.storage.numel() == 10 + 1 and bucket.buffer.numel() == 10
    bucket.views[0].fill_(1.0)  # parameter 1 comes first in the bucket
    bucket.views[1].fill_(2.0)
    assert bucket.buffer.tolist() == [1.0] * 4 + [2.0] * 6
    assert bucket.views[1].shape == (2, 3)


def test_grad_bucket_offers_torch_gradbucket_methods():
    params = [torch.nn.Parameter(torch.randn(2, 3)), torch.nn.Parameter(torch.randn(4))]
    bucket = _bucket(5, [1, 0], params)
    facade = GradBucket(bucket, is_last=True)
    for name in [m for m in dir(dist.GradBucket) if not m.startswith("_")]:
        assert callable(getattr(facade, name)), name
    assert facade.index() == 5 and facade.is_last()
    assert [g.shape for g in facade.gradients()] == [(4,), (2, 3)]
    assert facade.parameters()[0] is params[1]
    replacement = torch.ones(10)
    facade.set_buffer(replacement)
    assert facade.buffer() is replacement


@pytest.mark.parametrize("large", [False, True])
def test_bucket_fills_scaled_gradients_and_zeros_for_missing_ones(large):
    width = 20000 if large else 3  # few large tensors are scaled per tensor, many small ones in one pass
    params = [torch.nn.Parameter(torch.randn(2, width, dtype=torch.float64)) for _ in range(3)]
    bucket = _bucket(0, [2, 0, 1], params)
    assert bucket.large_tensors == large
    for p in params:
        p.grad = torch.randn_like(p)
    bucket.fill_(0.5)
    assert torch.equal(bucket.buffer, torch.cat([params[i].grad.reshape(-1) * 0.5 for i in (2, 0, 1)]))
    params[0].grad = None  # unused on this rank: it contributes zeros
    bucket.fill_(None)
    assert torch.equal(bucket.views[1], torch.zeros(2, width, dtype=torch.float64))
    assert torch.equal(bucket.views[0], params[2].grad)


def test_bucket_writes_back_only_parameters_used_somewhere():
    params = [torch.nn.Parameter(torch.randn(4)) for _ in range(3)]
    bucket = _bucket(0, [0, 1, 2], params)
    params[0].grad, params[1].grad = torch.zeros(4), None
    bucket.buffer.copy_(torch.arange(12.0))
    bucket.write_back(used=[1, 1, 0])  # parameter 2 got a gradient nowhere: it keeps None
    assert params[0].grad.tolist() == [0.0, 1.0, 2.0, 3.0] and params[1].grad.tolist() == [4.0, 5.0, 6.0, 7.0]
    assert params[2].grad is None


def test_bucket_as_view_makes_gradients_views_of_the_bucket():
    params = [torch.nn.Parameter(torch.randn(5)) for _ in range(2)]
    bucket = _bucket(0, [0, 1], params, as_view=True)
    for p in params:
        p.grad = torch.ones(5)
    bucket.fill_(0.25)
    assert all(p.grad.data_ptr() == view.data_ptr() for p, view in zip(params, bucket.views))
    assert bucket.buffer.tolist() == [0.25] * 10
    params[0].grad.add_(1.0)  # accumulated in place: filling again only scales
    bucket.fill_(2.0)
    assert params[0].grad.tolist() == [2.5] * 5 and params[1].grad.tolist() == [0.5] * 5
    bucket.detach_gradient_views()
    assert params[0].grad.data_ptr() != bucket.views[0].data_ptr() and params[0].grad.tolist() == [2.5] * 5


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int32])
@pytest.mark.parametrize("world", [1, 2, 3, 64])
def test_tags_summed_over_the_world_stay_exact(dtype, world):
    modulus = tag_modulus(dtype, world)
    largest = torch.tensor(modulus - 1, dtype=dtype)
    assert modulus > 1
    assert int((largest * world).item()) == (modulus - 1) * world


def test_inputs_move_recursively():
    moved = move_to({"a": [torch.zeros(1), (torch.ones(1), 3)]}, torch.device("cpu"))
    assert isinstance(moved["a"][1], tuple) and moved["a"][1][1] == 3


def test_without_a_process_group_ddp_says_to_init():
    if dist.is_initialized():
        pytest.skip("a process group exists in this test process")
    with pytest.raises(WorldConfigError, match="phalanx.init"):
        phalanx.DistributedDataParallel(torch.nn.Linear(2, 2))
