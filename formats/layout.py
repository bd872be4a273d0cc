"""Which part of a model an arena holds (the whole model, or one pipeline stage's part for one tensor-parallel rank).

Plain data with no torch: daemon clients and the CLI import it without paying for torch.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Layout:
    """Which part of a model an arena holds: tensor-parallel rank ``tp_rank`` of ``tp_size`` in pipeline stage
    ``pp_stage`` of ``pp_size``. ``Layout()`` is the whole model."""

    tp_rank: int = 0
    tp_size: int = 1
    pp_stage: int = 0
    pp_size: int = 1

    @property
    def whole(self) -> bool:
        return self.tp_size == 1 and self.pp_size == 1

    @property
    def sizes(self) -> tuple[int, int]:
        return self.tp_size, self.pp_size

    def check(self) -> Layout:
        """Itself, or ValueError naming what is out of range."""
        if self.tp_size < 1 or self.pp_size < 1 or not 0 <= self.tp_rank < self.tp_size \
                or not 0 <= self.pp_stage < self.pp_size:
            raise ValueError(f"{self}: need sizes >= 1, 0 <= tp_rank < tp_size and 0 <= pp_stage < pp_size")
        return self

    def __str__(self) -> str:
        if self.whole:
            return "the whole model"
        parts = ([f"pipeline stage {self.pp_stage} of {self.pp_size}"] if self.pp_size > 1 else []) + \
            ([f"tensor-parallel rank {self.tp_rank} of {self.tp_size}"] if self.tp_size > 1 else [])
        return ", ".join(parts)


def describe_sizes(tp_size: int, pp_size: int) -> str:
    """How a model is split: "one arena", "2 tensor-parallel shards", "2 pipeline stages x 2 tensor-parallel ..."."""
    if (tp_size, pp_size) == (1, 1):
        return "one arena"
    parts = ([f"{pp_size} pipeline stages"] if pp_size > 1 else []) + \
        ([f"{tp_size} tensor-parallel shards"] if tp_size > 1 else [])
    return " x ".join(parts)
