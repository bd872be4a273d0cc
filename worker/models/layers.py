"""Layers whose weights are attached after construction (views into a file read or the daemon's arena).

Layers are built with meta-device placeholders that record the expected shape; ``bind`` swaps in the real
tensor without copying it, after checking the shape. Weights are plain tensor attributes, not Parameters:
they may be read-only views into shared memory and are never trained.

Tensor parallelism (worker/parallel): a row-parallel ``Linear`` has ``reduce`` set (the all-reduce over the ranks)
and adds its bias once, after the reduce (its LoRA part, a partial sum too, before it); ``VocabParallelEmbedding``
holds one rank's vocabulary rows.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from keepwarm import kernels


class WeightBindError(ValueError):
    pass


class BoundModule(nn.Module):
    """A module with named weight slots filled by :meth:`bind`."""

    def _slot(self, name: str, shape: tuple[int, ...]) -> None:
        setattr(self, name, torch.empty(shape, device="meta"))

    def bind(self, name: str, tensor: torch.Tensor) -> None:
        current = getattr(self, name, None)
        if not isinstance(current, torch.Tensor):
            raise WeightBindError(f"{type(self).__name__} has no weight slot {name!r}")
        expected = tuple(current.shape)
        if tuple(tensor.shape) != expected:
            raise WeightBindError(f"{name}: expected shape {expected}, got {tuple(tensor.shape)}")
        object.__setattr__(self, name, tensor)  # plain attribute: no Parameter wrapping, no copy


class Linear(BoundModule):
    """``y = x W^T + b``; the weight may later be a quantized form that ``kernels.linear`` understands."""

    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self._slot("weight", (out_features, in_features))
        self.bias: torch.Tensor | None = None
        if bias:
            self._slot("bias", (out_features,))
        self.lora = None  # a keepwarm.worker.lora.LoRALayer when LoRA is enabled
        # Row-parallel under tensor parallelism: sums the ranks' partial outputs (then the bias, once).
        self.reduce: Callable[[torch.Tensor], torch.Tensor] | None = None

    def bind(self, name: str, tensor: torch.Tensor) -> None:
        if name == "weight" and getattr(tensor, "is_quantized_weight", False):
            if tuple(tensor.shape) != (self.out_features, self.in_features):
                raise WeightBindError(f"weight: expected shape {(self.out_features, self.in_features)}, "
                                      f"got {tuple(tensor.shape)}")
            object.__setattr__(self, "weight", tensor)
            return
        super().bind(name, tensor)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.reduce is not None:  # the rank's LoRA part joins its partial sum before the one all-reduce
            y = kernels.linear(x, self.weight)
            y = self.reduce(y if self.lora is None else self.lora.apply(x, y))
            return y if self.bias is None else y.add_(self.bias.to(y.dtype))
        y = kernels.linear(x, self.weight, self.bias)
        return y if self.lora is None else self.lora.apply(x, y)


class RMSNorm(BoundModule):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self._slot("weight", (hidden_size,))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return kernels.rms_norm(x, self.weight, self.eps)
        return kernels.fused_add_rms_norm(x, residual, self.weight, self.eps)


class Embedding(BoundModule):
    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self._slot("weight", (num_embeddings, embedding_dim))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.embedding(ids, self.weight)


class VocabParallelEmbedding(Embedding):
    """Rows ``[start, start + rows)`` of the vocabulary; ids outside them embed to zero and the all-reduce over
    the ranks fills them in (each id lives on exactly one rank)."""

    def __init__(self, rows: int, embedding_dim: int, start: int,
                 reduce: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__(rows, embedding_dim)
        self.start, self.rows = start, rows
        self.reduce = reduce

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.rows)
        out = torch.nn.functional.embedding(local.masked_fill(outside, 0), self.weight)
        return self.reduce(out.masked_fill_(outside[:, None], 0))
