"""The clients' tensors as an aggregation strategy reads them (`Clients`): one client's tensor loaded at
a time, in its input dtype, or float64 and pulled towards phi_t where clipping scales the client's update
(`clip_scales`, the first pass over the adapters). `strategies` and the modules of its computations
(`strategies_robust`, `strategies_products`) build on it; it imports none of them.
"""

from __future__ import annotations

import dataclasses
from typing import Iterator, Mapping, Sequence

import torch

from fedse.model.adapter import clip_factor

_F64 = torch.float64


@dataclasses.dataclass(frozen=True)
class Clients:
    """The clients' tensors as the strategy sees them: as loaded (input dtype), or float64 and pulled
    towards phi_t for a client whose update is clipped. Consumers accumulate in float64 either way."""

    adapters: list[Mapping[str, torch.Tensor]]
    previous: Mapping[str, torch.Tensor]
    scales: list[float]  # per client, min(1, clip_norm / ||delta_k||); all 1.0 without clipping
    lora_scalings: list[float] = dataclasses.field(default_factory=list)  # per client, s_k (mixed ranks)
    out_scaling: float = 1.0  # s_R of the result (mixed ranks)
    examples: list[int] = dataclasses.field(default_factory=list)  # per client, num_examples (flexlora)

    def __len__(self) -> int:
        return len(self.adapters)

    def tensors(self, name: str) -> tuple[torch.dtype, Iterator[torch.Tensor]]:
        """The input dtype of `name` and an iterator loading client k's tensor only when it is reached."""
        first = self.adapters[0][name]
        return first.dtype, self._iterate(name, first)

    def _iterate(self, name: str, first: torch.Tensor) -> Iterator[torch.Tensor]:
        prev = self.previous[name].to(_F64) if min(self.scales) < 1.0 else None
        for k, (adapter, scale) in enumerate(zip(self.adapters, self.scales)):
            t = first if k == 0 else adapter[name]
            # Never in place: t may be the caller's tensor.
            yield t if scale >= 1.0 else prev + scale * (t.to(_F64) - prev)


def clip_scales(adapters: Sequence[Mapping[str, torch.Tensor]], previous: Mapping[str, torch.Tensor],
                clip_norm: float) -> list[float]:
    """min(1, clip_norm / ||phi_k - phi_t||) per client, the norm over all tensors (first pass, tensor by tensor)."""
    squares = [0.0] * len(adapters)
    for name in previous:
        prev = previous[name].to(_F64)
        for k, adapter in enumerate(adapters):
            squares[k] += float(torch.sub(adapter[name], prev).square().sum())
    return [clip_factor(s, clip_norm) for s in squares]
