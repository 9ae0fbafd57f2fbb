"""bf16 weights held in the bytes of the fp32 ones, and the exact fp32 weights back.

bf16 autocast inference needs each dense layer's weight in bf16.  Casting it in every
call reads the whole fp32 model once per forward; keeping a cast copy costs half the
model's memory again.  Packing does neither: the 4n bytes of an fp32 weight of n elements
are rewritten as two halves,

    bytes [0, 2n):   hi, the weight rounded to bf16 (a contiguous tensor the bf16 kernel reads)
    bytes [2n, 4n):  lo, the int16 remainders  bits(w) - (bits(hi) << 16), in an order of
                     their own (``pack_``)

so that ``bits(w) = (bits(hi) << 16) + lo`` gives every fp32 weight back bit for bit.  Both
directions work in place, chunk by chunk, with temporaries of one chunk's size.

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
            and weight.numel() > 0 and all(bool(torch.isfinite(part).all()) for part in weight.view(-1).split(_CHUNK)))


def _halves(weight: torch.Tensor) -> torch.Tensor:
    """``weight``'s bytes as 2n int16 slots: element i's fp32 bits fill slots 2i (low) and 2i+1 (high)."""
    return weight.detach().view(-1).view(torch.int16)


def _chunks(n: int) -> list[tuple[int, int]]:
    return [(start, min(start + _CHUNK, n)) for start in range(0, n, _CHUNK)]


def pack_(weight: torch.Tensor) -> torch.Tensor:
    """Rewrite ``weight``'s bytes as (hi, lo) in place; return hi, the bf16 weight, shaped as ``weight``.

    Chunks [b, c) of elements go in increasing order.  Before chunk [b, c), slots [0, b) hold
    hi of elements [0, b), slots [b, 2b) their lo, and slots [2b, 2n) the untouched elements
    [b, n).  The chunk reads its elements (slots [2b, 2c)), moves the lo values in slots [b, c)
    to slots [2b, b + c) (no overlap: a chunk is never longer than b), writes its own lo to
    slots [b + c, 2c) and its hi to [b, c), which leaves the same picture for c.
    """
    bits, halves = weight.detach().view(-1).view(torch.int32), _halves(weight)
    for b, c in _chunks(bits.numel()):
        part = bits[b:c]
        upper = (part + 0x8000) >> 16  # finite values: no int32 overflow, fits int16
        lo = (part - (upper << 16)).to(torch.int16)  # in [-0x8000, 0x7fff]
        hi = upper.to(torch.int16)
        if b > 0:
            halves[2 * b:b + c] = halves[b:c]
        halves[b + c:2 * c] = lo
        halves[b:c] = hi
    return packed_view(weight)


def packed_view(weight: torch.Tensor) -> torch.Tensor:
    """The bf16 weight (hi) of a packed ``weight``, without copying."""
    return _halves(weight)[:weight.numel()].view(torch.bfloat16).view(weight.shape)


def unpack_(weight: torch.Tensor) -> None:
    """Give a packed ``weight`` its exact fp32 bytes back, in place: ``pack_``'s chunks undone
    in decreasing order, each one's moved lo values put back where it found them."""
    bits, halves = weight.detach().view(-1).view(torch.int32), _halves(weight)
    for b, c in reversed(_chunks(bits.numel())):
        restored = (halves[b:c].to(torch.int32) << 16) + halves[b + c:2 * c]
        if b > 0:
            halves[b:c] = halves[2 * b:b + c]
        bits[b:c] = restored
