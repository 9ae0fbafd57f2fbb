"""bf16 weights held in the bytes of the fp32 ones, and the exact fp32 weights back.

bf16 autocast inference needs each dense layer's weight in bf16.  Casting it in every
call reads the whole fp32 model once per forward; keeping a cast copy costs half the
model's memory again.  Packing does neither: the 4n bytes of an fp32 weight of n elements
are rewritten as two halves,

    bytes [0, 2n):   hi, the weight rounded to bf16 (a contiguous tensor the bf16 kernel reads)
    bytes [2n, 4n):  lo, the int16 remainder  bits(w) - (bits(hi) << 16)

so that ``bits(w) = (bits(hi) << 16) + lo`` gives every fp32 weight back bit for bit.

Rounding: hi is w's bit pattern plus half a bf16 unit, shifted right by 16, i.e. round to
nearest with ties away from zero.  Autocast rounds ties to even; the two differ only for a
weight whose low 16 bits are exactly 0x8000 and whose upper half is even (one weight in
131,072 of random values), which comes out one bf16 unit larger in magnitude.  Exact
round-to-nearest-even cannot be stored this way: an even bf16 value is the nearest one of
2^16 + 1 fp32 values, one more than 16 bits can tell apart.

While a weight is packed, reading the fp32 parameter directly gives meaningless values;
the module that packed it (``FastLinear``) unpacks it before anything reads it through the
module (state_dict, train(), copies, ``.to()``, ``restore``).
"""
from __future__ import annotations

import torch

# Elements converted at a time: bounds the int32 temporaries to a few hundred KB.
_CHUNK = 1 << 16


def packable(weight: torch.Tensor) -> bool:
    """Whether ``weight`` can be packed: a contiguous fp32 CPU tensor of finite values."""
    return (weight.dtype == torch.float32 and weight.device.type == "cpu" and weight.is_contiguous()
            and weight.numel() > 0 and bool(torch.isfinite(weight).all()))


def _halves(weight: torch.Tensor) -> torch.Tensor:
    """``weight``'s bytes as 2n int16 values: element i's fp32 bits are at [2i, 2i+1] (low, high)."""
    return weight.detach().view(-1).view(torch.int16)


def pack_(weight: torch.Tensor) -> torch.Tensor:
    """Rewrite ``weight``'s bytes as (hi, lo) in place; return hi, the bf16 weight, shaped as ``weight``.

    Only lo is made whole beside the weight: hi goes straight into place, chunk by chunk in
    increasing order, since hi of elements [a, b) lands on the bytes of elements [a/2, b/2),
    all already read.
    """
    bits = weight.detach().view(-1).view(torch.int32)
    halves = _halves(weight)
    n = bits.numel()
    lo = torch.empty(n, dtype=torch.int16)
    for start in range(0, n, _CHUNK):
        stop = start + _CHUNK
        part = bits[start:stop]
        upper = (part + 0x8000) >> 16  # finite values: no int32 overflow, fits int16
        lo[start:stop] = part - (upper << 16)  # in [-0x8000, 0x7fff]
        halves[start:start + upper.numel()] = upper
    halves[n:] = lo
    return packed_view(weight)


def packed_view(weight: torch.Tensor) -> torch.Tensor:
    """The bf16 weight (hi) of a packed ``weight``, without copying."""
    return _halves(weight)[:weight.numel()].view(torch.bfloat16).view(weight.shape)


def unpack_(weight: torch.Tensor) -> None:
    """Give a packed ``weight`` its exact fp32 bytes back, in place.

    lo is copied out first; then the fp32 bits go into place chunk by chunk in decreasing
    order: element i's bits land on hi of elements 2i and 2i+1, already restored.
    """
    halves = _halves(weight)
    bits = weight.detach().view(-1).view(torch.int32)
    n = bits.numel()
    lo = halves[n:].clone()
    for start in reversed(range(0, n, _CHUNK)):
        stop = min(start + _CHUNK, n)
        restored = (halves[start:stop].to(torch.int32) << 16) + lo[start:stop]
        bits[start:stop] = restored
