"""Each tensor-parallel rank's slice of a plain tensor, read straight from the checkpoint file into its own buffer.

Rules:
- A rank's cut (:func:`keepwarm.weights.sharding.plan_cut`: rows, cols or vocab segments of the fused tensor, or
  None: all of it) becomes byte ranges of the source parts, in file order: a rows segment is one range per part it
  touches, a cols segment one range per row (read with one ``preadv`` per run of adjacent ranges, scattering a row
  over the ranks' buffers).
- Ranks may hold the same bytes (KV heads replicated when ``num_key_value_heads`` < N, a tied head on the last
  stage): each range is read from the file once, into its first holder, and copied to the others.
- Every source byte must be held by some rank; the part's sha256 is then taken over the ranges in file order (the
  digest a whole read gives, so the fingerprint does not depend on how it was read). Cuts that do not cover the
  tensor exactly once, the copies set aside, return None: the caller reads the whole tensor instead.
- Only plain tensors (kept as stored, converted, or packed for oneDNN after the cut): a quantized layout is
  quantized whole and cut after, since its per-row scales span every column.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass

import torch

from keepwarm.weights.checkpoint import FusedTensor, tensor_bytes
from keepwarm.weights.sharding import Segments

Cut = tuple[str, Segments] | None  # plan_cut's answer for one destination
_IOV_MAX = 1024  # Linux's limit on one preadv's vector
_READ_BYTES = 8 << 20  # bytes per preadv (enough to stream; small enough to hash while in cache)


@dataclass(frozen=True)
class Piece:
    part: int  # index into the fused tensor's parts
    offset: int  # byte offset in that part
    length: int
    dest: int  # which destination buffer
    at: int  # byte offset in that buffer


def slice_shape(t: FusedTensor, cut: Cut) -> tuple[int, ...]:
    """The shape of ``t`` cut as ``cut`` says."""
    if cut is None or (len(t.shape) == 1 and cut[0] == "cols"):
        return t.shape
    kind, segs = cut
    n = sum(length for _, length in segs)
    return (n, *t.shape[1:]) if kind in ("rows", "vocab") else (t.shape[0], n)


def _pieces(t: FusedTensor, cut: Cut, dest: int) -> list[Piece]:
    """Where destination ``dest``'s bytes come from, in its own order."""
    item = torch.empty((), dtype=t.dtype).element_size()
    row = item * (t.shape[1] if len(t.shape) == 2 else 1)
    starts, r = [], 0  # the fused rows each part begins at
    for p in t.parts:
        starts.append(r)
        r += p.nbytes // row
    total_rows = r

    def rows(first: int, count: int, at: int) -> list[Piece]:
        out = []
        for i, p in enumerate(t.parts):
            lo, hi = max(first, starts[i]), min(first + count, starts[i] + p.nbytes // row)
            if lo < hi:
                out.append(Piece(i, (lo - starts[i]) * row, (hi - lo) * row, dest, at + (lo - first) * row))
        return out

    if cut is None or (len(t.shape) == 1 and cut[0] == "cols"):
        return rows(0, total_rows, 0)
    kind, segs = cut
    if kind == "cols":
        (s, n), = segs
        return [Piece(i, lr * row + s * item, n * item, dest, (starts[i] + lr) * n * item)
                for i, p in enumerate(t.parts) for lr in range(p.nbytes // row)]
    out, at = [], 0
    for first, count in segs:
        out += rows(first, min(count, max(0, total_rows - first)) if kind == "vocab" else count, at)
        at += count * row
    return out


def _preadv_all(fd: int, views: list[memoryview], offset: int) -> None:
    """Fill ``views`` from ``fd`` at ``offset`` (the file's bytes back to back), past any short read."""
    while views:
        n = os.preadv(fd, views, offset)
        if n <= 0:
            raise OSError(f"short read at {offset}")
        offset += n
        while views and n >= len(views[0]):
            n -= len(views[0])
            views = views[1:]
        if n:
            views = [views[0][n:], *views[1:]]


def _read_part(path: str, base: int, nbytes: int, pieces: list[Piece], bufs: list[memoryview]) -> str:
    """Read one source part's ranges (in file order, covering it exactly) into their buffers; its sha256."""
    h = hashlib.sha256()
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, base, nbytes, os.POSIX_FADV_WILLNEED)
        i = 0
        while i < len(pieces):
            batch, size = [pieces[i]], pieces[i].length
            while (i + len(batch) < len(pieces) and len(batch) < _IOV_MAX and size < _READ_BYTES):
                batch.append(pieces[i + len(batch)])
                size += batch[-1].length
            views = [bufs[q.dest][q.at:q.at + q.length] for q in batch]
            _preadv_all(fd, list(views), base + batch[0].offset)
            for v in views:
                h.update(v)
            i += len(batch)
    finally:
        os.close(fd)
    return h.hexdigest()


def read_slices(t: FusedTensor, cuts: list[Cut], buffer: torch.Tensor) -> tuple[list[torch.Tensor], list[str]] | None:
    """Each destination's slice of ``t`` (shapes :func:`slice_shape`, ``t.dtype``), read from the file into
    ``buffer`` (uint8, at least their bytes together), and each source part's sha256; None when the cuts do not
    cover the tensor (see the module rules)."""
    item = torch.empty((), dtype=t.dtype).element_size()
    shapes = [slice_shape(t, c) for c in cuts]
    sizes = [item * torch.Size(s).numel() for s in shapes]
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    if sum(sizes) > buffer.numel():
        raise ValueError(f"{t.name}: a buffer of {buffer.numel()} bytes cannot hold {sum(sizes)}")
    raw = tensor_bytes(buffer)
    bufs = [raw[s:s + n] for s, n in zip(starts, sizes, strict=True)]
    first: dict[tuple[int, int, int], Piece] = {}
    copies: list[tuple[Piece, Piece]] = []
    for d, cut in enumerate(cuts):
        for q in _pieces(t, cut, d):
            key = (q.part, q.offset, q.length)
            if key in first:
                copies.append((q, first[key]))
            else:
                first[key] = q
    by_part: list[list[Piece]] = [[] for _ in t.parts]
    for q in sorted(first.values(), key=lambda q: (q.part, q.offset)):
        by_part[q.part].append(q)
    for part, pieces in zip(t.parts, by_part, strict=True):
        ends = [q.offset + q.length for q in pieces]
        if [q.offset for q in pieces] != [0, *ends[:-1]] or (ends[-1] if ends else 0) != part.nbytes:
            return None
    digests = [_read_part(str(p.file), p.offset, p.nbytes, pieces, bufs)
               for p, pieces in zip(t.parts, by_part, strict=True)]
    for q, src in copies:
        bufs[q.dest][q.at:q.at + q.length] = bufs[src.dest][src.at:src.at + src.length]
    for d, cut in enumerate(cuts):  # the vocabulary's padding rows (past the last real row)
        held = sum(q.length for q in _pieces(t, cut, d))
        if held < sizes[d]:
            buffer[starts[d] + held:starts[d] + sizes[d]].zero_()
    return [buffer[s:s + n].view(t.dtype).view(shape) for s, n, shape in zip(starts, sizes, shapes, strict=True)], \
        digests
