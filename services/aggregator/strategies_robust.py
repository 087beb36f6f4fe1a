"""The robust strategies' computation (median, trimmed_mean): coordinate-wise, the K clients' values of a
tensor stacked (K x numel, float64), sorted in slices and averaged between the cuts (`trimmed`), in
buffers reused from tensor to tensor (`Workspace`).
"""

from __future__ import annotations

import torch

from .strategies_clients import Clients

_F64 = torch.float64
_SORT_ELEMENTS = 1 << 20  # median / trimmed mean sort at most this many values at once


class Workspace:
    """Buffers reused from tensor to tensor (median, trimmed mean). Fresh (K x numel) stacks and sort
    outputs for every tensor, interleaved with the small output tensors that stay, fragment glibc's
    heap: the peak RSS reached 1.3 GB for K = 20 over an 80 MB adapter, against ~0.15 GB reused."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    def take(self, key: str, shape: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
        numel = shape[0] * shape[1]
        buffer = self._buffers.get(key)
        if buffer is None or buffer.numel() < numel:
            self._buffers[key] = buffer = torch.empty(numel, dtype=dtype)
        return buffer[:numel].view(shape)


def trimmed(clients: Clients, name: str, cut: int, work: Workspace) -> tuple[torch.Tensor, torch.dtype]:
    """Coordinate-wise: sort the K values, drop `cut` at each end, average the rest.
    cut = (K-1)//2 is the median (the middle value, or the mean of the two middle ones)."""
    k = len(clients)
    dtype, tensors = clients.tensors(name)
    stack: torch.Tensor | None = None
    shape = torch.Size()
    for i, t in enumerate(tensors):
        if stack is None:
            shape = t.shape
            stack = work.take("stack", (k, t.numel()), _F64)
        stack[i] = t.reshape(-1)
    assert stack is not None
    n = stack.shape[1]
    out = torch.empty(n, dtype=_F64)
    step = max(1, _SORT_ELEMENTS // k)
    for start in range(0, n, step):
        part = stack[:, start:start + step]
        values = work.take("values", tuple(part.shape), _F64)
        indices = work.take("indices", tuple(part.shape), torch.int64)
        torch.sort(part, dim=0, out=(values, indices))
        torch.mean(values[cut:k - cut], dim=0, out=out[start:start + part.shape[1]])
    return out.view(shape), dtype
