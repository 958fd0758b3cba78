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
