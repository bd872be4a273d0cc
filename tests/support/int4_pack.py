"""The inverse of ``keepwarm.formats.quant.unpack_int4``, written from torch's weight_to_int4pack_kernel
description, not from the project's code: tests pack int4 codes with it and check the project's unpacking and
kernels against it. Also the quantized-kernel tests' shared cases (tests/unit/kernels/test_cpu_quant_avx2.py,
tests/unit/kernels/test_cpu_amx.py): int4 weights with their float64 dequantization, the one-rounding bound, and the
check that torch's own pack gives a kernel the hand pack's results."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from keepwarm.formats.quant import cpu_int4_layout


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


def halves(codes: torch.Tensor, block: int) -> torch.Tensor:
    """torch's CPU int4 "halves" pack of `block` rows, flat (as the kernels read it)."""
    return pack_int4(codes, f"int4_cpu_halves{block}").view(-1)


def q4_case(n: int, k: int, gs: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """codes [N, K] (0..15) and (scale, zero) [K/gs, N, 2] in bf16, and the float64 weight (c - 8) * s + z."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.int32)
    scales = (torch.rand(k // gs, n, generator=g) * 0.02 + 1e-4).bfloat16()
    zeros = (torch.randn(k // gs, n, generator=g) * 0.01).bfloat16()
    sz = torch.stack((scales, zeros), dim=-1).contiguous()
    w = (codes.double() - 8).view(n, k // gs, gs) * scales.double().T[..., None] + zeros.double().T[..., None]
    return codes, sz, w.view(n, k)


def within_one_rounding(got: torch.Tensor, true: torch.Tensor, mag: torch.Tensor) -> None:
    """|got - true| <= one bf16 rounding of true plus float32 summation error (relative to sum |x w|)."""
    err = (got.double() - true).abs()
    bound = true.abs() * 2.0 ** -8 + 1e-5 * mag
    assert bool((err <= bound).all()), f"max excess {float((err - bound).max()):.3g}"


def torch_pack_matches_hand_pack(linear: Callable[..., torch.Tensor]) -> None:
    """torch's own int4 pack (the arena's layout on this CPU) gives `linear` (an int4 kernel taking the halves
    pack: x, qweight, scales_and_zeros, group size, block) the same results as the hand pack."""
    layout = cpu_int4_layout()
    if layout is None or not layout.startswith("int4_cpu_halves"):
        pytest.skip(f"this torch packs int4 as {layout}, not in halves")
    block = int(layout.removeprefix("int4_cpu_halves"))
    codes, sz, _ = q4_case(3 * block, 256, 64, 11)
    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(4)).bfloat16()
    ours = torch._convert_weight_to_int4pack_for_cpu(codes, 2)
    assert torch.equal(ours.view(-1), halves(codes, block))
    assert torch.equal(linear(x, ours, sz, 64, block), linear(x, halves(codes, block), sz, 64, block))
