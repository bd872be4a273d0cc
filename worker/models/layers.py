"""Layers whose weights are attached after construction (views into a file read or the daemon's arena).

Layers are built with meta-device placeholders that record the expected shape; ``bind`` swaps in the real
tensor without copying it, after checking the shape. Weights are plain tensor attributes, not Parameters:
they may be read-only views into shared memory and are never trained.
"""

from __future__ import annotations

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

    def bind(self, name: str, tensor: torch.Tensor) -> None:
        if name == "weight" and getattr(tensor, "is_quantized_weight", False):
            if tuple(tensor.shape) != (self.out_features, self.in_features):
                raise WeightBindError(f"weight: expected shape {(self.out_features, self.in_features)}, "
                                      f"got {tuple(tensor.shape)}")
            object.__setattr__(self, "weight", tensor)
            return
        super().bind(name, tensor)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
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
