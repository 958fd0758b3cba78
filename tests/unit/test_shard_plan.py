"""Who owns which elements of a bucket when sharding (bucket/shard_plan.py), and how the memory
benchmark counts bytes (each byte once)."""

import torch

from phalanx.bucket.buckets import Bucket
from phalanx.bucket.shard_plan import CHUNK_ALIGN, chunk_size, cut_bucket
from phalanx.tools.bench_memory import _distinct_bytes


def _bucket(shapes):
    params = [torch.nn.Parameter(torch.randn(*shape)) for shape in shapes]
    indices = list(range(len(params)))
    return Bucket(0, indices, params, torch.zeros(Bucket.storage_numel(indices, params))), params


def test_chunks_are_equal_aligned_and_cover_the_bucket_and_its_tag():
    for numel in (1, 15, 16, 100, 1000, 12345):
        for world in (1, 2, 3, 4, 7):
            chunk = chunk_size(numel, world)
            assert chunk % CHUNK_ALIGN == 0
            assert chunk * world >= numel + 1  # the gradients and the step tag
            assert chunk * (world - 1) < numel + 1 + CHUNK_ALIGN * world  # no rank's chunk is much larger


def test_pieces_of_all_ranks_tile_every_parameter_exactly_once():
    bucket, params = _bucket([(5, 7), (3,), (40, 3), (1,)])
    for world in (1, 2, 3, 4):
        covered = [torch.zeros(p.numel(), dtype=torch.int32) for p in params]
        for rank in range(world):
            shard = cut_bucket(bucket, rank, world)
            for piece in shard.pieces:
                covered[piece.index][piece.start:piece.stop] += 1
                assert piece.offset + piece.numel <= shard.chunk
                assert piece.tensor.data_ptr() == params[piece.index].data_ptr() + 4 * piece.start
                if piece.whole:
                    assert piece.tensor.shape == params[piece.index].shape
                else:
                    assert piece.tensor.dim() == 1 and piece.tensor.numel() == piece.numel
        assert all(bool((c == 1).all()) for c in covered), f"world {world}"


def test_a_piece_updated_in_place_updates_the_parameter():
    bucket, params = _bucket([(6, 6)])
    piece = cut_bucket(bucket, 1, 2).pieces[0]
    piece.tensor.add_(1.0)
    flat = params[0].detach().view(-1)
    before = flat.clone() - 1.0
    assert torch.equal(flat[piece.start:piece.stop], before[piece.start:piece.stop] + 1.0)


def test_bytes_are_counted_once_across_views_and_overlaps():
    base = torch.zeros(100)
    assert _distinct_bytes([base, base[10:20], base.view(10, 10)]) == 400
    assert _distinct_bytes([base[:60], base[40:]]) == 400
    assert _distinct_bytes([base[:10], torch.zeros(5)]) == 60
