"""Oort's guided selection (Lai et al., OSDI 2021, "Oort: Efficient Federated Learning via Guided
Participant Selection"), hardened against members that report what suits them.

What drives it, and how each signal is checked:

- statistical utility, reported by the client: its latest success gain, else its latest training
  loss. The round keeper passes only reports of rounds the client took part in (chosen and
  uploaded), `ClientHistory` drops values out of range (a success ratio outside [0, 1], a negative
  or non-finite loss) and clips a loss above MAX_LOSS, and here a signal counts by its rank among
  the alive clients reporting it, never by its size: the best scores 1.0, the worst 1/n, so a loss
  of 1e30 weighs what the highest honest loss weighs;
- the system factor, observed by the server: with T the median of the alive clients' mean round
  times, a client slower than T (d > T) is scaled by (T/d)^alpha;
- reliability, observed by the server: the share of the rounds it was chosen for that it uploaded;
- staleness, observed by the server: STALENESS_BONUS per round since it was last chosen. One
  round left out weighs as much as the whole range of the reported utility, so what a client says
  orders clients equally long out of the federation and cannot buy a place every round.

K places (clients_per_round, or ceil(fraction * alive)); E of them explore: round(epsilon * K) (half
up) but at least one when K >= 2, and at K = 1 the one place explores with probability epsilon (a
seeded draw per round: epsilon-greedy). Explorers are clients never tried (drawn as `sample` draws),
then the tried ones longest unchosen. The other places go to the highest scores (utility times the
two factors plus the staleness bonus; unknown utility counts 0). epsilon 0 turns exploration off.
"""

from __future__ import annotations

import hashlib
import json
import math
import statistics
from typing import Any

from .base import ClientHistory, Policy, SelectionInput, _Count, _dead, _draw, _number

STALENESS_BONUS = 1.0  # added to a score per round since the client was last chosen


def ranks(values: dict[str, float]) -> dict[str, float]:
    """Each value's rank among them, scaled to (0, 1]: the largest 1.0, the smallest 1/n, ties share
    their mean rank. Robust by construction: how far an outlier lies changes nothing."""
    ordered = sorted(values.values())
    n = len(ordered)
    out = {}
    for key, v in values.items():
        below = sum(x < v for x in ordered)
        equal = sum(x == v for x in ordered)
        out[key] = (below + (equal + 1) / 2) / n
    return out


def rounds_out(c: ClientHistory, round_: int) -> int:
    """Rounds since the client was last chosen (all of them when never chosen)."""
    last = max((r for r in c.rounds_selected if r < round_), default=-1)
    return round_ - last - 1


class Utility(Policy):
    """Oort's guided selection: see the module doc for what drives it and how it is checked."""

    name = "utility"
    description = ("Oort: top clients by the rank of their success gain (else loss) times speed and reliability, "
                   "plus a bonus per round left out; epsilon explores untried, then long-unchosen ones")

    def __init__(self, clients_per_round: int | None = None, fraction: float | None = None,
                 epsilon: float = 0.2, alpha: float = 2.0) -> None:
        self.count = _Count(self.name, clients_per_round, fraction)
        if not _number(epsilon) or not 0.0 <= epsilon <= 1.0:
            raise ValueError(f"epsilon must be in [0, 1] (the share of slots that explore clients never tried; "
                             f"0 turns exploration off), got {epsilon!r}; use e.g. 0.2")
        if not _number(alpha) or not (math.isfinite(alpha) and alpha >= 0):
            raise ValueError(f"alpha must be a finite number >= 0 (how hard a slow client is penalised; "
                             f"0: not at all), got {alpha!r}; use e.g. 2")
        self.epsilon, self.alpha = float(epsilon), float(alpha)

    def config(self) -> dict[str, Any]:
        return {"name": self.name, **self.count.config(), "epsilon": self.epsilon, "alpha": self.alpha}

    def utilities(self, inp: SelectionInput) -> dict[str, tuple[float | None, str]]:
        """Each alive tried client's utility (None: unknown) before the staleness bonus, and what scaled
        it, by client id."""
        alive = [c for c in inp.alive() if c.tried]
        gains = ranks({c.client_id: c.success_gain for c in alive if c.success_gain is not None})
        losses = ranks({c.client_id: c.last_loss for c in alive if c.last_loss is not None})
        durations = [c.mean_round_s for c in inp.alive() if c.mean_round_s is not None]
        preferred = statistics.median(durations) if durations else None
        out: dict[str, tuple[float | None, str]] = {}
        for c in alive:
            stat = gains.get(c.client_id, losses.get(c.client_id))
            if stat is None:
                out[c.client_id] = (None, "")
                continue
            note = ""
            if preferred is not None and c.mean_round_s is not None and c.mean_round_s > preferred:
                stat *= (preferred / c.mean_round_s) ** self.alpha
                note += f" (slow: {c.mean_round_s:.0f} s, median {preferred:.0f} s)"
            if c.rounds_selected and c.dropouts:
                kept = max(0.0, 1 - c.dropouts / len(c.rounds_selected))
                stat *= kept
                note += f" (uploaded {kept:.0%} of its rounds)"
            out[c.client_id] = (stat, note)
        return out

    def explorers(self, inp: SelectionInput, k: int) -> int:
        """How many of the k places explore (the module doc)."""
        if self.epsilon == 0 or k == 0:
            return 0
        if k >= 2:
            return max(1, math.floor(self.epsilon * k + 0.5))
        text = json.dumps(["fedse-selection", "utility-greedy", inp.seed, inp.run_id, inp.round])
        draw = int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big") / 2 ** 64
        return int(draw < self.epsilon)

    def _choose(self, inp: SelectionInput) -> tuple[set[str], dict[str, str]]:
        alive = inp.alive()
        k = self.count.of(len(alive))
        utility = self.utilities(inp)
        order = {c.client_id: i for i, c in enumerate(_draw(inp, "utility-ties", alive))}
        out = {c.client_id: rounds_out(c, inp.round) for c in alive}
        score = {cid: (v or 0.0) + STALENESS_BONUS * out[cid] for cid, (v, _) in utility.items()}
        fresh = [c.client_id for c in _draw(inp, "utility-explore", [c for c in alive if not c.tried])]
        longest = sorted(utility, key=lambda cid: (-out[cid], order[cid]))
        explore = (fresh + longest)[:min(self.explorers(inp, k), len(alive))]
        ranked = sorted((cid for cid in utility if cid not in explore), key=lambda cid: (-score[cid], order[cid]))
        exploit = ranked[:k - len(explore)]
        exploit += [cid for cid in fresh if cid not in explore][:k - len(explore) - len(exploit)]
        chosen = set(explore) | set(exploit)
        reasons = {}
        for c in inp.clients:
            cid = c.client_id
            if not c.alive:
                reasons[cid] = _dead(c)
            elif cid in explore:
                reasons[cid] = ("exploring: never tried" if cid in fresh else
                                f"exploring: not chosen for {out[cid]} rounds")
            elif cid in utility:
                value, note = utility[cid]
                shown = "unknown (nothing reported)" if value is None else f"{value:.2f}{note}"
                reasons[cid] = (f"utility {shown}, {out[cid]} rounds out, rank {ranked.index(cid) + 1} of "
                                f"{len(ranked)}; top {len(exploit)} taken")
            elif cid in chosen:
                reasons[cid] = "never tried: fills a place"
            else:
                reasons[cid] = f"never tried, not drawn to explore ({len(explore)} explore)"
        return chosen, reasons
