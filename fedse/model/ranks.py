"""Mixed LoRA ranks: each organisation trains its own rank r_k and alpha a_k, up to a run-wide maximum R.

Client k's update to a module is dW_k = s_k B_k A_k, with B_k (out x r_k), A_k (r_k x in) and its
scaling s_k = a_k / r_k (a_k / sqrt(r_k) with rsLoRA), as its adapter_config.json says. A run with
mixed ranks holds its global adapter at rank R with lora_alpha R (scaling 1: the factors carry the
update as it is), which is what the exported PEFT directory says and stock peft loads.

What both sides need, the aggregator and the clients, lives here:
- `scaling`, `rank_of`, `at_rank`, `check_fits`: a client's rank and scaling from its schema, the run's
  schema at rank R, and the check that a client's schema fits it;
- `padded` and `truncated`: zero-padding of a client's factors to rank R, as HetLoRA pads (B scaled by
  s_k / s_R, so that the padded product is the client's update) and its inverse, the first r_k
  components; `held`: which values of the padded adapter are the client's own (all its clip counts);
- `held_rank`, `thinly_held`, `zero_above`: under secure aggregation, no component summed over fewer
  than the threshold of uploads;
- `best_rank`: the best rank-r factors of a product given as stacked factors, B_cat A_cat, through a QR
  of each and an SVD of the small core (never the out x in matrix), and `refactored`, which a client
  uses to bring the global adapter to its own rank and scaling.
"""

from __future__ import annotations

import json
import math
from typing import Iterable, Iterator, Mapping

import torch

from fedse.model.adapter import AdapterError, Schema, TensorSpec, check_tensors

_F64 = torch.float64
A_PART, B_PART = ".lora_A.", ".lora_B."
RUN_SCALING = 1.0  # a mixed-rank run's adapter: rank R, lora_alpha R


def run_schema(schema: Schema, max_rank: int) -> Schema:
    """A mixed-rank run's adapter schema from a client's: every factor at max_rank, lora_alpha max_rank."""
    return at_rank(schema, max_rank, max_rank * RUN_SCALING)


def to_own_rank(adapter: Mapping[str, torch.Tensor], strategy: str, rank: int, own_scaling: float
                ) -> dict[str, torch.Tensor]:
    """The run's global adapter as a client of `rank` and `own_scaling` trains from it: the first components
    for zero-pad (as HetLoRA truncates), the best rank-`rank` approximation for the product strategies."""
    if strategy == "zero-pad":
        return truncated(adapter, rank, own_scaling / RUN_SCALING)
    return refactored(adapter, rank, own_scaling, RUN_SCALING)


def partner(name: str) -> str | None:
    """`X.lora_B.<...>` for `X.lora_A.<...>` (covers `.lora_A.weight` and `.lora_A.<adapter>.weight`)."""
    head, sep, tail = name.rpartition(A_PART)
    return f"{head}{B_PART}{tail}" if sep else None


def pairs(names) -> list[tuple[str, str]]:
    """Every (lora_A, lora_B) pair among `names`, in the order of the A names."""
    present = set(names)
    return [(a, b) for a in names if (b := partner(a)) is not None and b in present]


def _config(config_json: str) -> dict:
    try:
        config = json.loads(config_json)
    except ValueError:
        config = None
    if not isinstance(config, dict):
        raise AdapterError("adapter_config_json is not a JSON object: send the adapter's adapter_config.json")
    return config


def scaling(config_json: str) -> float:
    """The LoRA scaling of an adapter_config.json: lora_alpha / r, or lora_alpha / sqrt(r) with rsLoRA."""
    config = _config(config_json)
    r, alpha = config.get("r"), config.get("lora_alpha")
    if not (isinstance(r, int) and r > 0 and isinstance(alpha, (int, float)) and math.isfinite(alpha) and alpha > 0):
        raise AdapterError(f"adapter_config_json gives r={r!r} and lora_alpha={alpha!r}: both must be positive "
                           "numbers (r an integer)")
    return float(alpha) / (math.sqrt(r) if config.get("use_rslora") else r)


def _factor_ranks(schema: Schema) -> set[int]:
    """The ranks the schema's LoRA factors say (A: r x in, B: out x r); -1 for a factor that is not 2-D."""
    specs = schema.by_name()
    return {r for a, b in pairs(list(specs))
            for r in (specs[a].shape[0] if len(specs[a].shape) == 2 else -1,
                      specs[b].shape[1] if len(specs[b].shape) == 2 else -1)}


def rank_of(schema: Schema) -> int:
    """The one rank of the schema's LoRA factors (A: r x in, B: out x r), which its config's r must say;
    AdapterError if the factors disagree or there are none."""
    ranks = _factor_ranks(schema)
    if not ranks:
        raise AdapterError("the adapter has no lora_A/lora_B pairs: mixed ranks need LoRA factors")
    if len(ranks) != 1 or min(ranks) < 1:
        raise AdapterError(f"the adapter's LoRA factors have ranks {sorted(ranks)}: every lora_A must be r x in and "
                           "every lora_B out x r for one r (a rank_pattern per module is not supported)")
    (r,) = ranks
    config = _config(schema.adapter_config_json)
    if config.get("rank_pattern") or config.get("alpha_pattern"):
        raise AdapterError("adapter_config_json sets rank_pattern or alpha_pattern: mixed ranks need one r and one "
                           "lora_alpha per client")
    if config.get("r") != r:
        raise AdapterError(f"adapter_config_json says r={config.get('r')!r} but the LoRA factors have rank {r}")
    return r


def rank_or_zero(schema: Schema) -> int:
    """The schema's one LoRA rank as its factors say, or 0 when they do not say one."""
    ranks = _factor_ranks(schema)
    return ranks.pop() if len(ranks) == 1 and min(ranks) >= 1 else 0


def at_rank(schema: Schema, r: int, alpha: float) -> Schema:
    """The schema with every LoRA factor at rank r and its config saying r and lora_alpha (no patterns)."""
    specs = schema.by_name()
    a_names = {a for a, _ in pairs(list(specs))}
    b_names = {b for _, b in pairs(list(specs))}
    tensors = tuple(TensorSpec(s.name, (r, s.shape[1]) if s.name in a_names else
                               (s.shape[0], r) if s.name in b_names else s.shape, s.dtype)
                    for s in schema.tensors)
    config = _config(schema.adapter_config_json)
    config.update(r=r, lora_alpha=int(alpha) if float(alpha).is_integer() else alpha, rank_pattern={},
                  alpha_pattern={}, use_rslora=False)
    return Schema(tensors, json.dumps(config, sort_keys=True))


def check_fits(run: Schema, client: Schema, max_rank: int) -> int:
    """The client's rank when its schema fits a run whose adapter is `run` (at rank max_rank): the same
    tensors and dtypes, the same module shapes, at a rank of 1 to max_rank; AdapterError saying what
    differs otherwise."""
    r = rank_of(client)
    if r > max_rank:
        raise AdapterError(f"LoRA rank {r} is above the run's maximum of {max_rank}: train with --lora-r "
                           f"{max_rank} or less")
    scaling(client.adapter_config_json)
    expected = at_rank(run, r, r)
    check_tensors(expected, client.by_name(), expected_by="the run at this client's rank")
    return r


# ---- zero-padding (as HetLoRA pads) and truncation ------------------------------------------------

class Padded(Mapping[str, torch.Tensor]):
    """A client's adapter as the run's rank-R adapter: each lora_A gets zero rows and each lora_B zero
    columns up to R, and B is scaled by `factor` = s_k / s_R, so that s_R B' A' = s_k B_k A_k. Tensors
    are made one at a time, on lookup (the aggregator walks adapters tensor by tensor)."""

    def __init__(self, adapter: Mapping[str, torch.Tensor], rank: int, factor: float):
        self.adapter, self.rank, self.factor = adapter, rank, factor

    def __getitem__(self, name: str) -> torch.Tensor:
        t = self.adapter[name]
        if A_PART in name and t.dim() == 2 and t.shape[0] < self.rank:
            return torch.cat([t, t.new_zeros((self.rank - t.shape[0], t.shape[1]))], dim=0)
        if B_PART in name and t.dim() == 2:
            if self.factor != 1.0:
                t = (t.to(_F64) * self.factor).to(t.dtype)
            if t.shape[1] < self.rank:
                t = torch.cat([t, t.new_zeros((t.shape[0], self.rank - t.shape[1]))], dim=1)
        return t

    def __iter__(self) -> Iterator[str]:
        return iter(self.adapter)

    def __len__(self) -> int:
        return len(self.adapter)


def padded(adapter: Mapping[str, torch.Tensor], rank: int, factor: float) -> dict[str, torch.Tensor]:
    """Padded's tensors, all made now."""
    view = Padded(adapter, rank, factor)
    return {name: view[name] for name in adapter}


def held(adapter: Mapping[str, torch.Tensor], rank: int) -> dict[str, torch.Tensor]:
    """Which values of a padded rank-R adapter a client of `rank` holds, as boolean masks of each LoRA
    factor: lora_A's first `rank` rows, lora_B's first `rank` columns (the rest is padding). Tensors
    that are not LoRA factors are left out: the client holds them whole."""
    out = {}
    for name, t in adapter.items():
        if t.dim() == 2 and (A_PART in name or B_PART in name):
            mask = torch.zeros(t.shape, dtype=torch.bool)
            if A_PART in name:
                mask[:rank] = True
            else:
                mask[:, :rank] = True
            out[name] = mask
    return out


def truncated(adapter: Mapping[str, torch.Tensor], rank: int, factor: float) -> dict[str, torch.Tensor]:
    """The first `rank` components of a rank-R adapter (HetLoRA's truncation): lora_A's first rows, lora_B's
    first columns divided by `factor` = s_k / s_R; the other tensors as they are."""
    out = {}
    for name, t in adapter.items():
        if A_PART in name and t.dim() == 2:
            t = t[:rank].clone()
        elif B_PART in name and t.dim() == 2:
            t = (t[:, :rank].to(_F64) / factor).to(t.dtype)
        out[name] = t
    return out


# ---- secure aggregation: no component held by fewer than t uploads -------------------------------
# With zero-padding, component j of every LoRA pair (A's row j, B's column j) is summed over the
# clients of rank > j only: where fewer than the threshold t hold it, the unmasked sum would give
# their few values (one client's, where only it holds it). So a client sends its components up to the
# t-th largest rank among those that shared (`held_rank`) and zeroes the rest (`zero_above`); the
# aggregator, and each client before it reveals, check the uploaders hold every component sent at
# least t times (`thinly_held`). Ranks are the members' advertised ones (RosterMember.lora_rank).

def held_rank(member_ranks: Iterable[int], t: int) -> int:
    """r*: the largest rank that at least `t` of `member_ranks` reach (their t-th largest), 0 where
    fewer than t are given. A client sends its components up to min(its rank, r*)."""
    top = sorted(member_ranks, reverse=True)
    return top[t - 1] if t >= 1 and len(top) >= t else 0


def thinly_held(sent: Iterable[int], t: int) -> int:
    """The highest component (1-based) that some but fewer than `t` of the uploads hold, given the rank
    each upload sent (min(its rank, r*)); 0 where every component sent is held by t or more. The
    uploads holding component j are those that sent j or more, fewer as j grows: checking the top
    one checks them all."""
    sent = list(sent)
    top = max(sent, default=0)
    return top if top > 0 and sum(r >= top for r in sent) < t else 0


def zero_above(adapter: Mapping[str, torch.Tensor], rank: int) -> dict[str, torch.Tensor]:
    """The adapter with every LoRA component above `rank` zeroed (lora_A's rows, lora_B's columns from
    `rank` on): what a client masks in place of components held by fewer than t. Other tensors, and
    an adapter of `rank` or less, as they are."""
    out = dict(adapter)
    for a_name, b_name in pairs(list(adapter)):
        a, b = adapter[a_name], adapter[b_name]
        if a.dim() == 2 and a.shape[0] > rank:
            out[a_name] = a.clone()
            out[a_name][rank:] = 0
        if b.dim() == 2 and b.shape[1] > rank:
            out[b_name] = b.clone()
            out[b_name][:, rank:] = 0
    return out


# ---- best rank-r factors --------------------------------------------------------------------------

def best_rank(b_cat: torch.Tensor, a_cat: torch.Tensor, rank: int, scale: float = 1.0
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(B', A', live) with scale * B' A' the best rank-`rank` approximation of b_cat @ a_cat, in float64.

    With b_cat = Q_b R_b and a_cat^T = Q_a R_a, the product is Q_b (R_b R_a^T) Q_a^T; the SVD U S V^T of
    the small core gives B' = Q_b U_r sqrt(S_r / scale) and A' = sqrt(S_r / scale) V_r^T Q_a^T, the
    components in order of their singular values. `live` marks the components whose singular value is
    not (numerically) zero; a dead one has a zero row in A' and a zero column in B', which the caller
    fills (a LoRA component with both zero never learns again)."""
    b_cat, a_cat = b_cat.to(_F64), a_cat.to(_F64)
    q_b, r_b = torch.linalg.qr(b_cat)      # (out x m), (m x n)
    q_a, r_a = torch.linalg.qr(a_cat.T)    # (in x p), (p x n)
    u, s, vh = torch.linalg.svd(r_b @ r_a.T, full_matrices=False)
    keep = min(rank, s.numel())
    return svd_factors(q_b @ u[:, :keep], s, vh[:keep] @ q_a.T, rank, scale, max(r_b.shape[0], r_a.shape[0]))


def svd_factors(u: torch.Tensor, s: torch.Tensor, vh: torch.Tensor, rank: int, scale: float, size: int
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(B', A', live) from an SVD U S V^H (float64; at least min(rank, len(S)) columns of U and rows of
    V^H): B' = U_r sqrt(S_r / scale), A' = sqrt(S_r / scale) V^H_r, padded with zeros to `rank`. `live`
    marks the singular values above the numerical noise of a `size`-sized matrix."""
    keep = min(rank, s.numel())
    tol = float(s.max()) * size * torch.finfo(_F64).eps if s.numel() else 0.0
    live = torch.zeros(rank, dtype=torch.bool)
    live[:keep] = s[:keep] > tol
    root = torch.zeros(rank, dtype=_F64)
    root[:keep] = torch.where(live[:keep], s[:keep] / scale, torch.zeros_like(s[:keep])).sqrt()
    b_new = torch.zeros((u.shape[0], rank), dtype=_F64)
    a_new = torch.zeros((rank, vh.shape[1]), dtype=_F64)
    b_new[:, :keep] = u[:, :keep] * root[:keep]
    a_new[:keep] = root[:keep, None] * vh[:keep]
    return b_new, a_new, live


def refactored(adapter: Mapping[str, torch.Tensor], rank: int, own_scaling: float, run_scaling: float = 1.0
               ) -> dict[str, torch.Tensor]:
    """A rank-R adapter (scaling `run_scaling`) brought to `rank` and `own_scaling`: per module, the
    factors of the best rank-`rank` approximation of its update, so that own_scaling * B A is the
    truncated SVD of run_scaling * B_R A_R. A component with no singular value left keeps B's column at
    zero and takes A's row from the adapter's own first rows (the product is unchanged and the
    component can still learn). Other tensors as they are; dtypes kept."""
    out = dict(adapter)
    for a_name, b_name in pairs(list(adapter)):
        a, b = adapter[a_name], adapter[b_name]
        b_new, a_new, live = best_rank(b.to(_F64) * run_scaling, a, rank, own_scaling)
        fill = a[:rank].to(_F64)
        dead = (~live).nonzero().flatten()
        dead = dead[dead < fill.shape[0]]
        a_new[dead] = fill[dead]
        out[a_name], out[b_name] = a_new.to(a.dtype), b_new.to(b.dtype)
    return out
