"""The models and data that `phalanx bench` times, one builder per name.

Each entry builds a fresh model from the current RNG state and makes a fixed list of batches, so
every variant of the benchmark (torch DDP, phalanx DDP, compute-only) trains the same weights on
the same data. The shapes stress different parts of DDP: few big tensors, many small ones, a mix.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class BenchModel:
    """A named benchmark model: how to build it, what one batch is, how its loss is taken."""

    name: str
    description: str
    batch: int
    build: Callable[[], nn.Module]
    make_batch: Callable[[torch.Generator, int], tuple]  # (generator, batch) -> (inputs, targets)
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def wide_mlp(width: int = 1024, depth: int = 8) -> nn.Module:
    """8 x [Linear(1024, 1024), ReLU]: few large gradient tensors (~8.4M parameters, 34 MB)."""
    layers = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers)


def deep_mlp(width: int = 128, depth: int = 60) -> nn.Module:
    """60 x [Linear(128, 128), LayerNorm(128), ReLU]: 180 small tensors, where per-tensor cost shows."""
    layers = []
    for _ in range(depth):
        # LayerNorm without bias: three tensors per layer, the ~180 of the spec (issue 3).
        layers += [nn.Linear(width, width), nn.LayerNorm(width, bias=False), nn.ReLU()]
    return nn.Sequential(*layers)


class CausalSelfAttention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, dim = x.shape
        q, k, v = self.qkv(x).split(dim, dim=2)
        q, k, v = (t.view(batch, seq, self.heads, dim // self.heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(batch, seq, dim))


class TransformerBlock(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = CausalSelfAttention(dim, heads)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class TinyGPT(nn.Module):
    """A GPT-style decoder: token + position embeddings, pre-norm blocks, an untied output head."""

    def __init__(self, vocab: int, seq: int, dim: int, layers: int, heads: int):
        super().__init__()
        self.token = nn.Embedding(vocab, dim)
        self.position = nn.Embedding(seq, dim)
        self.blocks = nn.Sequential(*(TransformerBlock(dim, heads) for _ in range(layers)))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.token(tokens) + self.position(positions)
        return self.head(self.norm(self.blocks(x)))


def _regression_batch(width: int, classes: int):
    def make(generator: torch.Generator, batch: int) -> tuple:
        inputs = torch.randn(batch, width, generator=generator)
        return inputs, torch.randint(0, classes, (batch,), generator=generator)
    return make


def _token_batch(vocab: int, seq: int):
    def make(generator: torch.Generator, batch: int) -> tuple:
        tokens = torch.randint(0, vocab, (batch, seq + 1), generator=generator)
        return tokens[:, :-1], tokens[:, 1:]  # predict the next token
    return make


def _classification_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output, target)


def _next_token_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def _gpt(vocab: int, seq: int, dim: int, layers: int, heads: int, batch: int, name: str, description: str):
    return BenchModel(name, description, batch, lambda: TinyGPT(vocab, seq, dim, layers, heads),
                      _token_batch(vocab, seq), _next_token_loss)


MODELS: dict[str, BenchModel] = {
    "wide": BenchModel("wide", "wide MLP: 8 x [Linear(1024,1024), ReLU]", 64, wide_mlp,
                       _regression_batch(1024, 1024), _classification_loss),
    "deep": BenchModel("deep", "deep MLP: 60 x [Linear(128,128), LayerNorm(128, no bias), ReLU]", 64, deep_mlp,
                       _regression_batch(128, 128), _classification_loss),
    "gpt": _gpt(vocab=256, seq=64, dim=256, layers=4, heads=4, batch=8, name="gpt",
                description="GPT-style: 4 layers, d=256, 4 heads, seq 64, vocab 256"),
    # For a GPU: ~135M parameters, in the range of GPT-2 small.
    "gpt-large": _gpt(vocab=32768, seq=512, dim=768, layers=12, heads=12, batch=8, name="gpt-large",
                      description="GPT-style: 12 layers, d=768, 12 heads, seq 512, vocab 32768"),
}


def make_batches(model: BenchModel, count: int, seed: int, rank: int, device: torch.device) -> list[tuple]:
    """`count` batches for this rank, the same for every variant (each rank gets different data)."""
    generator = torch.Generator().manual_seed(seed * 1000 + rank)
    return [tuple(t.to(device) for t in model.make_batch(generator, model.batch)) for _ in range(count)]


def count_parameters(module: nn.Module) -> tuple[int, int]:
    """(number of trainable parameters, number of trainable tensors)."""
    params = [p for p in module.parameters() if p.requires_grad]
    return sum(p.numel() for p in params), len(params)
