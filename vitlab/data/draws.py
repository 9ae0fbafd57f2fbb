"""Random draws for batch augmentation, from one generator or from one per part of the batch.

The streamed path gathers a batch from several readers, each reader's part with its own
seeded generator, so that a part is augmented the same whichever process gathers it.
``PartGenerators`` keeps that while the pixel work runs once on the whole batch: a draw
of per-image numbers (leading dimension B) takes each part's rows from that part's own
generator, so every part draws exactly the numbers it would draw alone.

A part may also carry a CPU generator for the per-image choices the host must read (which
RandAugment operation each image gets): drawn on a GPU, they would be read back, and the
host would wait for the device at every batch.
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence, Union

import torch

__all__ = ["PartGenerators", "rand", "randint", "randn"]


class PartGenerators:
    """The generators of a batch's consecutive parts, and the parts' sizes.

    hosts: optional CPU generators, one per part, for the per-image choices the host reads
    (``hosts`` then gives them as parts of their own).
    """

    def __init__(self, generators: Sequence[torch.Generator], sizes: Sequence[int],
                 hosts: Optional[Sequence[torch.Generator]] = None) -> None:
        if len(generators) != len(sizes) or not generators:
            raise ValueError(f"{len(generators)} generators for {len(sizes)} parts: need one per part, at least one")
        devices = {g.device for g in generators}
        if len(devices) > 1:
            raise ValueError(f"the parts' generators live on {sorted(map(str, devices))}: need one device")
        if hosts is not None and (len(hosts) != len(sizes) or any(g.device.type != "cpu" for g in hosts)):
            raise ValueError(f"hosts: {len(hosts)} generators for {len(sizes)} parts: need one CPU generator per part")
        self.parts = list(zip(generators, (int(n) for n in sizes)))
        self.device = generators[0].device
        self.total = sum(n for _, n in self.parts)
        self._hosts = None if hosts is None else list(hosts)

    @property
    def hosts(self) -> Optional["PartGenerators"]:
        """The parts' host generators as parts, or None where the parts have none."""
        return None if self._hosts is None else PartGenerators(self._hosts, [n for _, n in self.parts])


Generator = Union[torch.Generator, PartGenerators]


def _draw(sample: Callable[[tuple, torch.Generator], torch.Tensor], shape: tuple,
          generator: Generator) -> torch.Tensor:
    if not isinstance(generator, PartGenerators):
        return sample(tuple(shape), generator)
    if not shape or shape[0] != generator.total:
        raise ValueError(f"a draw of shape {tuple(shape)} from the generators of parts of {generator.total} images: "
                         "only per-image numbers come from the parts (per-batch ones need a host_generator)")
    return torch.cat([sample((n, *shape[1:]), g) for g, n in generator.parts])


def rand(shape: tuple, generator: Generator) -> torch.Tensor:
    """U(0, 1) of ``shape`` on the generator's device."""
    return _draw(lambda s, g: torch.rand(s, generator=g, device=g.device), shape, generator)


def randint(low: int, high: int, shape: tuple, generator: Generator) -> torch.Tensor:
    """Integers in [low, high) of ``shape`` on the generator's device."""
    return _draw(lambda s, g: torch.randint(low, high, s, generator=g, device=g.device), shape, generator)


def randn(shape: tuple, generator: Generator) -> torch.Tensor:
    """N(0, 1) of ``shape`` on the generator's device."""
    return _draw(lambda s, g: torch.randn(s, generator=g, device=g.device), shape, generator)
