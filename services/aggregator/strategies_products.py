"""The strategies that combine the products B_k A_k rather than the factors: exact (`exact_pair`, one
rank) and the mixed-rank hlora and flexlora (`mixed_pair`). Each stacks the clients' factors
(`stacked`) so that B_cat A_cat is the weighted sum of the products, and factors that back to a rank by
QR and a small SVD (fedse.model.ranks.best_rank); the out x in matrix is never formed.
"""

from __future__ import annotations

import torch

from fedse.model import ranks

from .strategies_clients import Clients

_F64 = torch.float64


def stacked(clients: Clients, a_name: str, b_name: str, coefficients: list[float]
            ) -> tuple[torch.Tensor, torch.Tensor, torch.dtype, torch.dtype, list[int]]:
    """(A_cat, B_cat, A's dtype, B's dtype, the clients' ranks): the clients' factors stacked, float64,
    A_cat = [A_1; ...; A_K] (sum r_k x in) and B_cat = [c_1 B_1 ... c_K B_K] (out x sum r_k), so that
    B_cat A_cat = sum_k c_k B_k A_k. One client's tensors are loaded at a time, each written into stacks
    made for K clients of the first one's rank (made larger where a later client's rank needs room)."""
    k = len(clients)
    a_dtype, a_tensors = clients.tensors(a_name)
    b_dtype, b_tensors = clients.tensors(b_name)
    a_cat = b_cat = torch.empty(0, dtype=_F64)
    at, client_ranks = 0, []
    for i, (a, b, c) in enumerate(zip(a_tensors, b_tensors, coefficients)):
        if a.dim() != 2 or b.dim() != 2 or b.shape[1] != a.shape[0]:
            raise ValueError(f"{a_name} {list(a.shape)} and {b_name} {list(b.shape)} are not LoRA factors "
                             "A (r x in) and B (out x r); use a strategy that averages tensors separately")
        r = a.shape[0]
        if at + r > a_cat.shape[0]:  # room for this client and the rest at its rank
            rows = at + r * (k - i)
            a_cat = torch.cat([a_cat[:at], torch.empty((rows - at, a.shape[1]), dtype=_F64)]) if at else \
                torch.empty((rows, a.shape[1]), dtype=_F64)
            b_cat = torch.cat([b_cat[:, :at], torch.empty((b.shape[0], rows - at), dtype=_F64)], dim=1) if at else \
                torch.empty((b.shape[0], rows), dtype=_F64)
        a_cat[at:at + r] = a
        b_cat[:, at:at + r] = b
        b_cat[:, at:at + r] *= c
        at += r
        client_ranks.append(r)
    return a_cat[:at], b_cat[:, :at], a_dtype, b_dtype, client_ranks


def exact_pair(clients: Clients, a_name: str, b_name: str) -> dict[str, tuple[torch.Tensor, torch.dtype]]:
    """A', B' of rank r with B'A' the best rank-r approximation of (1/K) sum_k B_k A_k.

    B_cat = [B_1/K ... B_K/K] (out x Kr) and A_cat = [A_1; ...; A_K] (Kr x in) give
    B_cat A_cat = (1/K) sum_k B_k A_k, which fedse.model.ranks.best_rank factors through a QR of each and an
    SVD of the (Kr x Kr) core. A component with a (numerically) zero singular value would leave both
    its A' row and its B' column zero, which no gradient can revive; it gets B' column 0 and the mean
    of the clients' A rows instead (the product is unchanged), so e.g. all-zero B gives fedavg's result.
    """
    k = len(clients)
    a_cat, b_cat, a_dtype, b_dtype, client_ranks = stacked(clients, a_name, b_name, [1.0 / k] * k)
    r = client_ranks[0]
    b_new, a_new, live = ranks.best_rank(b_cat, a_cat, r)
    mean_a = a_cat.view(k, r, -1).mean(dim=0)  # rows of dead components keep the mean A row
    a_new[~live] = mean_a[~live]
    return {a_name: (a_new, a_dtype), b_name: (b_new, b_dtype)}


def mixed_pair(clients: Clients, a_name: str, b_name: str, weights: list[float]
               ) -> dict[str, tuple[torch.Tensor, torch.dtype]]:
    """A', B' at phi_t's rank R with s_R B'A' the best rank-R approximation of
    dW = sum_k p_k s_k B_k A_k (p_k = weights normalised; s_k each client's scaling, s_R out_scaling),
    for hlora (p_k = 1/K) and flexlora (p_k ~ n_k) alike.

    The stacked factors (stacked, B_k scaled by p_k s_k) give B_cat A_cat = dW, factored by
    fedse.model.ranks.best_rank: a QR of each and an SVD of the (sum r_k x sum r_k) core, which has dW's
    nonzero singular values, so the result is dW's truncated SVD without the out x in matrix ever being
    formed. A component with no singular value left keeps B' column 0 and phi_t's A row."""
    total = float(sum(weights))
    coefficients = [p / total * s for p, s in zip(weights, clients.lora_scalings)]
    a_cat, b_cat, a_dtype, b_dtype, _ = stacked(clients, a_name, b_name, coefficients)
    previous_a = clients.previous[a_name].to(_F64)
    rank = previous_a.shape[0]
    b_new, a_new, live = ranks.best_rank(b_cat, a_cat, rank, clients.out_scaling)
    a_new[~live] = previous_a[~live]
    return {a_name: (a_new, a_dtype), b_name: (b_new, b_dtype)}
