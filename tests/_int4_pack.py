"""The inverse of ``keepwarm.formats.quant.unpack_int4``, written from torch's weight_to_int4pack_kernel
description, not from the project's code: tests pack int4 codes with it and check the project's unpacking and
kernels against it."""

from __future__ import annotations

import torch


def pack_int4(codes: torch.Tensor, layout: str) -> torch.Tensor:
    """codes [N, K] (uint8 or int, 0..15) in `layout`: ``int4_canonical``, or torch's CPU pack ``int4_cpu_{mode}
    {block}`` (row blocks of `block`, each stored k-major; "halves": byte j of a k holds rows j (low nibble) and
    j + block/2 (high); "pairs": rows 2j, 2j+1; a short last block is always pairs). Returns uint8 [N, K/2]."""
    codes = codes.to(torch.uint8)
    n, k = codes.shape
    if layout == "int4_canonical":
        return codes[:, 0::2] | (codes[:, 1::2] << 4)
    mode, block = layout.removeprefix("int4_cpu_")[:-2], int(layout[-2:])
    out = []
    for start in range(0, n, block):
        blk = codes[start:start + block].t()  # [K, rows]
        rows = blk.shape[1]
        if mode == "halves" and rows == block:
            out.append(blk[:, : block // 2] | (blk[:, block // 2:] << 4))
        else:
            out.append(blk[:, 0::2] | (blk[:, 1::2] << 4))
    return torch.cat([o.reshape(-1) for o in out]).view(n, k // 2)
