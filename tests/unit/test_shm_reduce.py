"""The chunk reduction of the shared-memory all-reduce: the compiled kernel against torch ops.

The kernel is built at install (setup.py); CI installs with a C compiler, so it must be there.
Both must give the same bits, or ranks of one job could disagree depending on how each was built.
"""

import pytest
import torch

from phalanx.shm import reduce as shm_reduce
from phalanx.shm.reduce import kernel_available, reduce_chunk, reduce_chunk_with_torch


def _parts(count: int, numel: int, dtype: torch.dtype, seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(numel, generator=generator, dtype=torch.float64).mul(10 ** (j % 3)).to(dtype)
            for j in range(count)]


def test_the_kernel_was_built():
    assert kernel_available(), "phalanx.shm._reduce_kernels is missing: was the package installed with a C compiler?"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("count", [2, 3, 5])
@pytest.mark.parametrize("numel", [1, 7, 2048, 2049, 100_003])
@pytest.mark.parametrize("average", [True, False])
def test_kernel_and_torch_give_the_same_bits(dtype, count, numel, average):
    with_kernel = _parts(count, numel, dtype, seed=numel + count)
    with_torch = [part.clone() for part in with_kernel]
    expected = with_kernel[0].double().clone()
    for part in with_kernel[1:]:
        expected += part.double()
    reduce_chunk(with_kernel, average, None)
    reduce_chunk_with_torch(with_torch, average, None)
    for a, b in zip(with_kernel, with_torch):
        assert torch.equal(a, b), "the kernel and torch ops disagree"
        assert torch.equal(a, with_kernel[0]), "every part must receive the result"
    if average:
        expected /= count
    tolerance = 1e-5 if dtype == torch.float32 else 1e-12
    torch.testing.assert_close(with_kernel[0].double(), expected, rtol=tolerance, atol=tolerance)


def test_half_precision_and_a_missing_kernel_use_torch(monkeypatch):
    parts = _parts(3, 5000, torch.bfloat16, seed=1)
    copies = [part.clone() for part in parts]
    scratch = torch.empty(shm_reduce.BLOCK_BYTES // 2, dtype=torch.float32)
    reduce_chunk(parts, True, scratch)
    reduce_chunk_with_torch(copies, True, scratch)
    assert all(torch.equal(a, b) for a, b in zip(parts, copies))
    monkeypatch.setattr(shm_reduce, "_kernel", None)
    floats = _parts(2, 300, torch.float32, seed=2)
    reduce_chunk(floats, False, None)
    assert torch.equal(floats[0], floats[1])


# -- many pieces in one call: the exchanges' copy-in, sums into gradients and fetches -------------

def _pieces(numel: int, dtype: torch.dtype) -> list[tuple[int, int]]:
    """(start, count) pieces of a flat tensor: empty, tiny, misaligned (odd starts) and large ones."""
    bounds = sorted({0, 1, 3, 10, 17, 1000, 2049, numel // 2 + 1, numel})
    return [(lo, hi - lo) for lo, hi in zip(bounds, bounds[1:])] + [(5, 0)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("scale", [None, 0.5, 1 / 3])
@pytest.mark.parametrize("shift", [0, 1])
def test_copy_pieces_gives_torchs_bits_with_either_kind_of_store(dtype, stream, scale, shift):
    """shift 1: source and target aligned differently (the streaming copy takes another way then)."""
    source = _parts(1, 70_001, dtype, seed=3)[0]
    source[7] = float("nan")  # copied as it is when not scaled
    target = torch.full((source.numel() + shift,), -1.0, dtype=dtype)[shift:]
    segments, expected = [], target.clone()
    for start, count in _pieces(source.numel(), dtype):
        segments += (target[start:].data_ptr(), source[start:].data_ptr(), count)
        piece = source[start:start + count]
        expected[start:start + count] = piece if scale is None else piece * scale
    shm_reduce.copy_pieces(segments, dtype, scale, stream)
    assert torch.equal(target.nan_to_num(123.0), expected.nan_to_num(123.0))
    assert target[7].isnan()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("count", [1, 2, 3])
def test_sum_pieces_is_the_rank_order_sum_of_torchs_adds(dtype, stream, count):
    parts = _parts(count, 50_003, dtype, seed=count)
    outputs, segments = [], []
    for start, size in _pieces(50_003, dtype):
        out = torch.empty(size + 1, dtype=dtype)[1:]  # a 4- or 8-byte-misaligned destination
        outputs.append((start, out))
        segments += (out.data_ptr() if size else 0, start, size)
    shm_reduce.sum_pieces(tuple(part.data_ptr() for part in parts), segments, dtype, stream)
    for start, out in outputs:
        expected = parts[0][start:start + out.numel()].clone()
        for part in parts[1:]:
            expected = expected + part[start:start + out.numel()]  # torch's add, in rank order
        assert torch.equal(out, expected), f"piece at {start}"


def test_the_kernel_refuses_malformed_segments():
    data = torch.zeros(4)
    with pytest.raises(ValueError, match="triples"):
        shm_reduce.copy_pieces([data.data_ptr(), data.data_ptr()], torch.float32, None, False)
    with pytest.raises(ValueError, match="triple 0"):
        shm_reduce.copy_pieces([0, data.data_ptr(), 4], torch.float32, None, False)  # null destination
    with pytest.raises(ValueError, match="null source"):
        shm_reduce.copy_pieces([data.data_ptr(), 0, 4], torch.float32, 0.5, False)
    with pytest.raises(ValueError, match="triple 0"):
        shm_reduce.sum_pieces((data.data_ptr(),), [data.data_ptr(), 0, -1], torch.float32, False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("count", [2, 3, 4])
def test_own_chunk_is_the_rank_order_sum_with_this_ranks_term_scaled(dtype, stream, count):
    """The split exchange's own chunk, for every rank's place in the order: the other ranks' terms as
    posted, this rank's scaled on the way in, summed in rank order with torch's ops."""
    numel, scale = 9_001, 1 / 3
    terms = _parts(count, numel, dtype, seed=10 + count)
    own = _parts(1, numel, dtype, seed=99)[0]
    for rank in range(count):
        out_a, out_b = torch.empty(numel + 1, dtype=dtype)[1:], torch.empty(numel, dtype=dtype)
        addresses = tuple(term.data_ptr() for term in terms)
        shm_reduce.sum_own_chunk(out_a.data_ptr(), out_b.data_ptr(), own.data_ptr(), addresses, numel,
                                 shm_reduce.KERNEL_DTYPES[dtype], scale, rank, stream)
        expected = None
        for j in range(count):
            term = own * scale if j == rank else terms[j]
            expected = term.clone() if expected is None else expected + term
        assert torch.equal(out_a, expected), f"rank {rank}"
        assert torch.equal(out_b, expected), f"rank {rank}, second output"
