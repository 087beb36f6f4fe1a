"""Aggregation strategies: pure functions over adapters, each named for what it averages.

Both strategies here average the LoRA factors A and B *separately* (the Fed-SE paper's default),
which is not the same as averaging the products B·A.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import torch

from fedse.adapter import Adapter


@dataclasses.dataclass(frozen=True)
class Update:
    client_id: str
    adapter: Adapter
    num_examples: int
    num_successes: int


def weighted_average(adapters: Sequence[Adapter], weights: Sequence[float]) -> Adapter:
    """sum_k w_k * phi_k / sum_k w_k for every tensor, accumulated in float64."""
    if not adapters:
        raise ValueError("nothing to aggregate")
    if len(weights) != len(adapters):
        raise ValueError("one weight per adapter")
    total = float(sum(weights))
    if total <= 0:
        raise ValueError("weights must sum to a positive number")
    out: Adapter = {}
    for name, first in adapters[0].items():
        acc = torch.zeros(first.shape, dtype=torch.float64)
        for adapter, w in zip(adapters, weights):
            acc.add_(adapter[name].to(torch.float64), alpha=float(w) / total)
        out[name] = acc.to(first.dtype)
    return out


def fedavg(updates: Sequence[Update]) -> Adapter:
    """Unweighted mean of A and of B over clients: phi_{t+1} = (1/K) sum_k phi_{t,k} (the paper's default)."""
    return weighted_average([u.adapter for u in updates], [1.0] * len(updates))


def weighted_by_successes(updates: Sequence[Update]) -> Adapter:
    """Mean of A and of B weighted by each client's successful trajectories (the paper's ablation).
    Falls back to the unweighted mean when no client has a success."""
    weights = [float(u.num_successes) for u in updates]
    if sum(weights) <= 0:
        return fedavg(updates)
    return weighted_average([u.adapter for u in updates], weights)


STRATEGIES: dict[str, Callable[[Sequence[Update]], Adapter]] = {
    "fedavg": fedavg,
    "weighted": weighted_by_successes,
}
