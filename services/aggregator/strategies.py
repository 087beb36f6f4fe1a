"""Aggregation strategies over adapters, one small object each, named for what it averages.

`aggregate(strategy, updates, previous, params, round_)` turns the K client adapters phi_k of round t
into phi_{t+1}. `previous` is phi_t, the global adapter the round started from; its keys name the
tensors and fix the output's order. The strategies, one `Strategy` object each (`BY_NAME`; their names
and descriptions, what `--strategy` accepts, in `STRATEGIES`):

- fedavg: mean of A and mean of B over clients, *separately* (the Fed-SE paper's default). Averaging
  the factors is not averaging the products: mean(B) mean(A) != mean(B_k A_k).
- weighted: the same, weighted by each client's successful trajectories (the paper's ablation); the
  unweighted mean when no client has a success.
- exact: the mean of the products, dW = (1/K) sum_k B_k A_k, factored back to rank r (its best
  rank-r approximation, via QR of the stacked factors and an SVD of a (Kr x Kr) core; the out x in
  matrix is never formed).
- hlora: for clients of mixed LoRA ranks, the exact weighted sum dW = sum_k p_k s_k B_k A_k (p_k = 1/K,
  s_k = alpha_k / r_k each client's scaling), factored to the run's maximum rank R as exact does (QR
  and a small SVD); each client then takes its best rank-r_k approximation (fedse.model.ranks.refactored).
- flexlora: FlexLoRA's redistribution (Bai et al. 2024): the same sum weighted by the clients'
  examples (p_k ~ n_k), cut to rank R. FlexLoRA forms the dense out x in matrix and runs a full SVD;
  the same truncation comes from the stacked factors as hlora's does (QR and a small SVD), which for
  a 7B block is well under a second against minutes and the dense matrix's memory.
- zero-pad: the zero-padding baseline for mixed ranks, which HetLoRA (Cho et al. 2024) compares
  against and builds on, without HetLoRA's sparsity-weighted aggregation or rank self-pruning: each
  client's A and B zero-padded to rank R (B scaled by s_k / s_R), then averaged as fedavg; each client
  takes the first r_k components. It is a plain mean of the padded uploads, so it is the mixed-rank
  strategy that secure aggregation can give.
- median: coordinate-wise median over clients; for even K the mean of the two middle values
  (torch.quantile(q=0.5) semantics, not torch.median, which returns the lower one).
- trimmed_mean: coordinate-wise, drop the floor(trim_fraction * K) smallest and as many largest
  values, average the rest.

Only `weighted` reads num_successes and only `flexlora` num_examples; the others weigh every client
equally.
Any strategy can clip first: with clip_norm > 0, client k's update becomes
phi_t + min(1, clip_norm / ||phi_k - phi_t||) (phi_k - phi_t), the norm taken over all its tensors.
With noise_multiplier > 0, Gaussian noise of std noise_multiplier * clip_norm / K is added to every
coordinate of the result, drawn from a generator seeded by (seed, round_). That std is the Gaussian
mechanism's calibration for the unweighted mean of clipped updates (fedavg); for the other
strategies the noise is added the same way but that accounting does not apply as such.

Memory: adapters may be lazy (`adapter_files.AdapterFile` loads one tensor per lookup). Everything
walks tensor by tensor (for exact, A/B pair by pair), loading one client's tensor at a time into a
running float64 sum (fedavg, weighted) or into one (K x numel) float64 stack (median, trimmed_mean,
exact's stacked factors), so the peak is about one output adapter plus K copies of one tensor,
never K adapters. Results are computed in float64 and returned in the input dtype.

This module holds the strategy objects, their parameters' checks, `aggregate`'s walk over the tensors
and FedBuff's fold (`fedbuff`); the computations it hands a tensor to live beside it: the clients'
tensors as a strategy reads them (`strategies_clients`), the coordinate-wise sort of median and
trimmed_mean (`strategies_robust`), and the products B_k A_k of exact, hlora and flexlora
(`strategies_products`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from typing import Mapping, Sequence

import torch

from fedse.model import ranks
from fedse.model.adapter import Adapter

from .strategies_clients import Clients, clip_scales
from .strategies_products import exact_pair, mixed_pair
from .strategies_robust import Workspace, trimmed

_F64 = torch.float64


@dataclasses.dataclass(frozen=True)
class Update:
    client_id: str
    adapter: Mapping[str, torch.Tensor]  # may be lazy: adapter_files.AdapterFile loads one tensor per lookup
    num_examples: int
    num_successes: int
    scaling: float = 1.0  # the client's LoRA scaling s_k (lora_alpha / r), read by the mixed-rank strategies


@dataclasses.dataclass(frozen=True)
class StrategyParams:
    trim_fraction: float = 0.2     # trimmed_mean: fraction cut from EACH end per coordinate, floor(f*K); in [0, 0.5)
    clip_norm: float = 0.0         # > 0: clip each client's delta phi_k - phi_t to this L2 norm over all its tensors
    noise_multiplier: float = 0.0  # > 0: Gaussian noise of std noise_multiplier * clip_norm / K; needs clip_norm > 0
    seed: int = 0                  # noise of round t comes from a generator seeded by (seed, t)


class Strategy:
    """One aggregation strategy, as `--strategy` names it: how it weighs the clients in a mean, and
    how it combines the clients' values of one tensor into phi_{t+1}'s. A paired strategy combines
    each lora_A with its lora_B (`combine_pair`); their other tensors go through `combine`."""

    name = ""
    description = ""  # one line, for --help and the docs
    paired = False
    mixed = False  # takes clients of different LoRA ranks (the run's adapter is at the maximum rank)
    pads = False   # sees each client's adapter zero-padded to the run's rank (fedse.model.ranks.Padded)
    linear = True  # the result is a (weighted) mean of the uploads: clipping, noise and secure sums apply
    noise_calibrated = False  # the Gaussian noise's std is calibrated for its result (the unweighted mean)

    def weights(self, successes: list[float]) -> list[float]:
        """Each client's weight in a mean, from its successful trajectories: all equal."""
        return [1.0] * len(successes)

    def combine(self, clients: Clients, name: str, weights: list[float], params: StrategyParams,
                work: Workspace) -> tuple[torch.Tensor, torch.dtype]:
        """phi_{t+1}'s tensor `name` (float64) and its input dtype: the weighted mean."""
        return _mean(clients, name, weights)

    def combine_pair(self, clients: Clients, a_name: str, b_name: str) -> dict[str, tuple[torch.Tensor, torch.dtype]]:
        raise NotImplementedError(f"{self.name} combines tensors one by one")


class FedAvg(Strategy):
    name = "fedavg"
    noise_calibrated = True
    description = "unweighted mean of A and of B, separately (the Fed-SE paper's default)"


class Weighted(Strategy):
    name = "weighted"
    description = "mean of A and of B weighted by successful trajectories (unweighted if none)"

    def weights(self, successes: list[float]) -> list[float]:
        return successes if sum(successes) > 0 else super().weights(successes)


class Exact(Strategy):
    name = "exact"
    description = "mean of the products B_k A_k, re-factored to rank r by truncated SVD"
    paired = True
    linear = False

    def combine_pair(self, clients: Clients, a_name: str, b_name: str) -> dict[str, tuple[torch.Tensor, torch.dtype]]:
        return exact_pair(clients, a_name, b_name)


class HLoRA(Strategy):
    name = "hlora"
    description = ("mixed ranks: the exact mean of the scaled products s_k B_k A_k, factored to the run's rank by "
                   "QR and a small SVD; each client takes its own rank's best part")
    paired = True
    mixed = True
    linear = False

    def combine_pair(self, clients: Clients, a_name: str, b_name: str) -> dict[str, tuple[torch.Tensor, torch.dtype]]:
        return mixed_pair(clients, a_name, b_name, [1.0] * len(clients))


class FlexLoRA(Strategy):
    name = "flexlora"
    description = ("mixed ranks: FlexLoRA, the sum of s_k B_k A_k weighted by examples, cut to the run's rank "
                   "(its truncated SVD, from the factors by QR and a small SVD); each client takes its own rank's "
                   "best part")
    paired = True
    mixed = True
    linear = False

    def combine_pair(self, clients: Clients, a_name: str, b_name: str) -> dict[str, tuple[torch.Tensor, torch.dtype]]:
        examples = [float(n) for n in clients.examples]
        return mixed_pair(clients, a_name, b_name, examples if sum(examples) > 0 else [1.0] * len(clients))


class ZeroPad(Strategy):
    name = "zero-pad"
    description = ("mixed ranks, the zero-padding baseline (HetLoRA's, without its sparsity weighting or rank "
                   "self-pruning): A and B zero-padded to the run's rank, then averaged")
    mixed = True
    pads = True
    noise_calibrated = True  # fedavg over the padded adapters


class Median(Strategy):
    name = "median"
    linear = False
    description = "coordinate-wise median over clients (mean of the two middle values for even K)"

    def combine(self, clients: Clients, name: str, weights: list[float], params: StrategyParams,
                work: Workspace) -> tuple[torch.Tensor, torch.dtype]:
        return trimmed(clients, name, (len(clients) - 1) // 2, work)


class TrimmedMean(Strategy):
    name = "trimmed_mean"
    linear = False
    description = "coordinate-wise mean after dropping floor(trim_fraction*K) values at each end"

    def combine(self, clients: Clients, name: str, weights: list[float], params: StrategyParams,
                work: Workspace) -> tuple[torch.Tensor, torch.dtype]:
        k = len(clients)
        # floor(f*K) with f < 0.5 cuts at most (K-1)//2 from each end, so at least one value remains;
        # the epsilon keeps e.g. 0.2 * 5 from flooring to 0 on a float rounding.
        return trimmed(clients, name, min(math.floor(params.trim_fraction * k + 1e-9), (k - 1) // 2), work)


BY_NAME: dict[str, Strategy] = {s.name: s for s in (FedAvg(), Weighted(), Exact(), HLoRA(), FlexLoRA(), ZeroPad(),
                                                   Median(), TrimmedMean())}
STRATEGIES: dict[str, str] = {name: s.description for name, s in BY_NAME.items()}
"""The strategy names `--strategy` accepts, each with a one-line description."""


def validate_params(strategy: str, params: StrategyParams) -> None:
    """Raises ValueError saying what to change when the strategy or its parameters cannot work."""
    if strategy not in BY_NAME:
        raise ValueError(f"unknown aggregation strategy {strategy!r}: use one of {', '.join(BY_NAME)}")
    if not (0.0 <= params.trim_fraction < 0.5):
        raise ValueError(f"trim_fraction {params.trim_fraction} is outside [0, 0.5): it is the fraction cut "
                         "from EACH end, so 0.5 or more would cut every client; use e.g. 0.2")
    if not (math.isfinite(params.clip_norm) and params.clip_norm >= 0):
        raise ValueError(f"clip_norm must be a finite number >= 0 (0 turns clipping off), got {params.clip_norm}")
    if not (math.isfinite(params.noise_multiplier) and params.noise_multiplier >= 0):
        raise ValueError(f"noise_multiplier must be a finite number >= 0 (0 turns noise off), "
                         f"got {params.noise_multiplier}")
    if BY_NAME[strategy].mixed and not BY_NAME[strategy].linear and (params.clip_norm > 0 or params.noise_multiplier > 0):
        raise ValueError(f"{strategy} combines the products B_k A_k of clients of different ranks, which clipping and "
                         "noise on the factors do not bound: use --strategy zero-pad with --clip-norm and "
                         "--noise-multiplier, or set both to 0")
    if params.noise_multiplier > 0 and params.clip_norm <= 0:
        raise ValueError("noise_multiplier > 0 needs clip_norm > 0: the noise std is noise_multiplier * "
                         "clip_norm / K, which only bounds a client's influence once updates are clipped; "
                         "set clip_norm (e.g. 1.0) or set noise_multiplier to 0")


def aggregate(strategy: str, updates: Sequence[Update], previous: Mapping[str, torch.Tensor],
              params: StrategyParams = StrategyParams(), round_: int = 0,
              out: Mapping[str, torch.Tensor] | None = None, out_scaling: float = 1.0) -> Adapter:
    """phi_{t+1} from the clients' phi_k and phi_t (`previous`), tensor by tensor (see the module doc).
    With `out` (tensors of previous's names, shapes and dtypes, e.g. `adapter_files.allocate`'s views
    of a file image), the result is written there and those tensors are returned. The mixed-rank
    strategies take clients of any rank up to previous's, each at its Update.scaling, and give
    phi_{t+1} at previous's rank and `out_scaling`."""
    validate_params(strategy, params)
    if not updates:
        raise ValueError("nothing to aggregate: the round has no updates")
    chosen = BY_NAME[strategy]
    k = len(updates)
    names = list(previous)
    adapters = [ranks.Padded(u.adapter, _rank(previous), u.scaling / out_scaling) if chosen.pads else u.adapter
                for u in updates]
    if not chosen.mixed:
        _check_one_rank(updates, previous)
    scales = clip_scales(adapters, previous, params.clip_norm) if params.clip_norm > 0 else [1.0] * k
    clients = Clients(adapters, previous, scales, [u.scaling for u in updates], out_scaling,
                       [u.num_examples for u in updates])
    weights = chosen.weights(_successes(updates))
    noise = _noise_generator(params.seed, round_) if params.noise_multiplier > 0 else None
    std = params.noise_multiplier * params.clip_norm / k
    work = Workspace()
    result: Adapter = {}
    for group in _groups(names, paired=chosen.paired):
        if len(group) == 2:
            combined = chosen.combine_pair(clients, *group)
        else:
            combined = {group[0]: chosen.combine(clients, group[0], weights, params, work)}
        for name in group:
            value, dtype = combined[name]
            if noise is not None:
                value = value + torch.randn(value.shape, generator=noise, dtype=_F64).mul_(std)
            result[name] = value.to(dtype) if out is None else out[name].copy_(value)
    return {name: result[name] for name in names}


def staleness_weight(tau: int) -> float:
    """FedBuff's weight of an update trained from a version tau behind: 1 / sqrt(1 + tau)."""
    return 1.0 / math.sqrt(1.0 + tau)


def fedbuff(current: Mapping[str, torch.Tensor], updates: Sequence[tuple[Mapping[str, torch.Tensor],
                                                                        Mapping[str, torch.Tensor], int]],
            out: Mapping[str, torch.Tensor], lr: float = 1.0) -> Adapter:
    """A buffer of asynchronous updates folded into the next version (FedBuff, Nguyen et al. 2022):
    phi_{v+1} = phi_v + eta_g (1/n) sum_i w(tau_i) (x_i - phi_{v_i}), each update x_i with the version
    phi_{v_i} it was trained from and its staleness tau_i = v - v_i (`updates`: (x_i, phi_{v_i}, tau_i)),
    eta_g the server learning rate `lr` (1: the mean update itself), in float64, tensor by tensor,
    written into `out` (phi_{v+1}'s views, e.g. `adapter_files.allocate`'s)."""
    if not updates:
        raise ValueError("nothing to fold: the buffer is empty")
    if not (math.isfinite(lr) and lr > 0):
        raise ValueError(f"the server learning rate is {lr}: give a positive finite number (1 = FedBuff's mean)")
    n = len(updates)
    for name in current:
        acc = current[name].to(_F64, copy=True)
        for adapter, base, tau in updates:
            acc.add_(adapter[name].to(_F64) - base[name].to(_F64), alpha=lr * staleness_weight(tau) / n)
        out[name].copy_(acc)
    return {name: out[name] for name in current}


# ---- internals ---------------------------------------------------------------------------------

def _rank(previous: Mapping[str, torch.Tensor]) -> int:
    """The rank of phi_t's LoRA factors (the run's maximum rank)."""
    found = [previous[a].shape[0] for a, _ in ranks.pairs(list(previous))]
    return max(found) if found else 0


def _check_one_rank(updates: Sequence[Update], previous: Mapping[str, torch.Tensor]) -> None:
    """ValueError unless every client's LoRA factors have phi_t's shapes (one rank in the run)."""
    for a, b in ranks.pairs(list(previous))[:1]:
        for u in updates:
            if tuple(u.adapter[a].shape) != tuple(previous[a].shape) or \
                    tuple(u.adapter[b].shape) != tuple(previous[b].shape):
                raise ValueError(f"client {u.client_id}'s LoRA factors are of another rank than the run's: averaging "
                                 "factors element by element needs one rank; use a mixed-rank strategy (hlora, "
                                 "flexlora or zero-pad)")


def _successes(updates: Sequence[Update]) -> list[float]:
    successes = [float(u.num_successes) for u in updates]
    if any(s < 0 for s in successes):
        raise ValueError(f"num_successes must not be negative, got {min(successes):g}: a negative weight would "
                         "put the average outside the adapters it averages")
    return successes


def _noise_generator(seed: int, round_: int) -> torch.Generator:
    digest = hashlib.sha256(f"fedse-aggregation-noise:{seed}:{round_}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)


def _groups(names: list[str], paired: bool) -> list[tuple[str, ...]]:
    """Tensors in the order of `names`; with `paired`, each lora_A with its lora_B as (A, B)."""
    present = set(names)
    partners = {b: a for a in names if (b := ranks.partner(a)) in present} if paired else {}
    groups: list[tuple[str, ...]] = []
    for name in names:
        if name in partners:  # a lora_B: it travels with its lora_A
            continue
        b = ranks.partner(name) if paired else None
        groups.append((name, b) if b in present else (name,))
    return groups


def _mean(clients: Clients, name: str, weights: list[float]) -> tuple[torch.Tensor, torch.dtype]:
    """sum_k w_k t_k / sum_k w_k as a running float64 sum, one client's tensor at a time (add_ promotes
    each tensor to float64 as it goes, without a float64 copy)."""
    total = float(sum(weights))
    dtype, tensors = clients.tensors(name)
    acc: torch.Tensor | None = None
    for t, w in zip(tensors, weights):
        if acc is None:
            acc = torch.zeros(t.shape, dtype=_F64)
        acc.add_(t, alpha=w / total)
    assert acc is not None
    return acc, dtype
