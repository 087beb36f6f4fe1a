"""Client-selection policies: who takes part in a round, one small object each, named for how it picks.

When round t opens, the round keeper calls `policy.select(SelectionInput)` and saves the `Selection`
it returns in its run state (`Selection.to_dict`, JSON). Policies are pure: everything one needs is in
its input (each client's history as the round keeper measured it, the run's seed, and the memory an
agent left in the previous round's Selection), they keep no state between calls, and the same input
gives the same selection, whatever the order of its clients. After a restart the round keeper reuses
the saved selection of the open round rather than choosing again: a restart makes everyone alive
(and heartbeats fresh) again, so the input it would build differs.

The policies (`make_policy(name, **params)`; names and descriptions, what --selector accepts, in
`POLICIES`):

- all: every alive client (the Fed-SE paper's setting; the default).
- sample: M of the N alive clients, uniformly at random: `clients_per_round` M, or `fraction`
  (M = ceil(fraction * N)). The draw comes from SHA-256 of (seed, run_id, round, client id): the same
  input draws the same clients after a restart, another round draws again, and a client's chance
  does not depend on the order of the input.
- available: alive clients heard from within `late_after_s`; a client with a late heartbeat is likely
  to stall the round until its deadline.
- utility: Oort's guided selection (Lai et al., OSDI 2021, "Oort: Efficient Federated Learning via
  Guided Participant Selection"): the top clients by the rank of their reported utility times what
  the server observes (speed, reliability) plus a bonus per round left out, and at least one place
  (epsilon K) exploring clients never tried or longest unchosen (see `selection_utility`).
- agent-tools, agent-llm: selector agents that decide K too, with their reasoning and memory
  (`selector_agents`).

Any of them can be wrapped in `FairnessFloor` (`every_f_rounds`), which adds every alive client left
out for F rounds, so that no organisation is starved by sampling, a low utility or an agent; the
aggregator wraps every selector but `all` in it by default (F = ceil(alive / places) + 1).

The shared types live in `selection_base`, `utility` in `selection_utility` (both re-exported here),
so that `selector_agents` imports neither this module nor a circle.

Guarantees, checked on every selection whatever the policy: no client that is not alive is chosen;
at least one client is chosen whenever at least one is alive; every client of the input, chosen or
not, has a short reason (what `fedse status` would show).
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from typing import Any

from .base import (  # noqa: F401 - re-exported: the policies' types, where they always were
    ClientHistory, Choice, Policy, Selection, SelectionInput, _Count, _age, _dead, _draw, _integer, _number)
from .utility import Utility
from .agents import AGENTS

DEFAULT_POLICY = "all"
NO_FLOOR = -1  # --fairness-rounds that turns the fairness floor off


class All(Policy):
    name = "all"
    description = "every alive client (the Fed-SE paper's setting)"

    def _choose(self, inp: SelectionInput) -> tuple[set[str], dict[str, str]]:
        return {c.client_id for c in inp.alive()}, {c.client_id: "alive" if c.alive else _dead(c) for c in inp.clients}


class Sample(Policy):
    name = "sample"
    description = "M of the N alive clients at random (clients_per_round M, or fraction of N), seeded per round"

    def __init__(self, clients_per_round: int | None = None, fraction: float | None = None) -> None:
        self.count = _Count(self.name, clients_per_round, fraction)

    def config(self) -> dict[str, Any]:
        return {"name": self.name, **self.count.config()}

    def _choose(self, inp: SelectionInput) -> tuple[set[str], dict[str, str]]:
        alive = inp.alive()
        m = self.count.of(len(alive))
        drawn = _draw(inp, "sample", alive)[:m]
        chosen = {c.client_id for c in drawn}
        taken = f"{len(chosen)} of {len(alive)} alive"
        reasons = {c.client_id: (_dead(c) if not c.alive else
                                 f"sampled, {taken}" if c.client_id in chosen else f"not sampled, {taken}")
                   for c in inp.clients}
        return chosen, reasons


class Available(Policy):
    name = "available"
    description = "alive clients heard from within late_after_s (a late one would stall the round)"

    def __init__(self, late_after_s: float = 15.0) -> None:
        # 15 s: three missed heartbeats at the default 5 s interval, half the default 30 s timeout.
        if not _number(late_after_s) or not (math.isfinite(late_after_s) and late_after_s > 0):
            raise ValueError(f"late_after_s must be a finite number of seconds > 0, got {late_after_s!r}; "
                             "set it below the heartbeat timeout, e.g. 15")
        self.late_after_s = float(late_after_s)

    def config(self) -> dict[str, Any]:
        return {"name": self.name, "late_after_s": self.late_after_s}

    def _choose(self, inp: SelectionInput) -> tuple[set[str], dict[str, str]]:
        alive = inp.alive()
        on_time = {c.client_id for c in alive if c.heartbeat_age_s < self.late_after_s}
        # Nobody on time: choose every alive client rather than none (the round still needs someone).
        chosen = on_time or {c.client_id for c in alive}
        reasons = {}
        for c in inp.clients:
            if not c.alive:
                reasons[c.client_id] = _dead(c)
            elif c.client_id in on_time:
                reasons[c.client_id] = f"heartbeat {_age(c)} ago"
            elif c.client_id in chosen:
                reasons[c.client_id] = f"heartbeat late ({_age(c)}), chosen: no alive client is on time"
            else:
                reasons[c.client_id] = f"heartbeat late ({_age(c)})"
        return chosen, reasons


class FairnessFloor(Policy):
    """Another policy, plus every alive client not selected in the last F rounds (rounds t-F .. t-1), or
    never selected once round F is reached: sampling, a low utility or an agent's judgement must not
    shut an organisation out of the federation for good. With F = 1 no alive client sits out two
    rounds in a row. every_f_rounds 0 (the aggregator's default) sets F each round to
    ceil(N / K) + 1 for N alive clients and K places (K = N where the policy takes no count): a fair
    rotation gives everyone a place every ceil(N / K) rounds, and the one more round leaves the policy
    room to prefer useful clients. The clients due are passed to the policy (SelectionInput.must), so
    that an agent can place them itself (agent-llm's answer must name them); any it leaves out are
    added."""

    def __init__(self, policy: Policy, every_f_rounds: int = 0) -> None:
        if isinstance(policy, FairnessFloor):
            raise ValueError("the policy is already under a fairness floor: wrap it once")
        if not _integer(every_f_rounds) or every_f_rounds < 0:
            raise ValueError(f"every_f_rounds must be an integer >= 0, got {every_f_rounds!r}: an alive client "
                             "left out that many rounds in a row is added (0: ceil(alive / places) + 1); use e.g. 5")
        self.policy, self.every_f_rounds = policy, int(every_f_rounds)
        self.name = f"{policy.name}+fairness_floor"
        self.description = f"{policy.description}; plus anyone left out for every_f_rounds"

    def config(self) -> dict[str, Any]:
        return {**self.policy.config(), "every_f_rounds": self.every_f_rounds}

    def rounds(self, alive: int) -> int:
        """F for a round with `alive` clients alive."""
        if self.every_f_rounds:
            return self.every_f_rounds
        inner = self.policy
        count = getattr(inner, "count", None) or getattr(getattr(inner, "tools", None), "count", None)
        places = count.of(alive) if count is not None else alive
        return math.ceil(alive / max(1, places)) + 1

    def due(self, inp: SelectionInput) -> dict[str, str]:
        """The alive clients the floor requires this round, each with why."""
        f, t = self.rounds(len(inp.alive())), inp.round
        out = {}
        for c in inp.alive():
            last = max((r for r in c.rounds_selected if r < t), default=None)
            if last is None and t >= f:
                out[c.client_id] = f"fairness floor: never chosen in {t} rounds"
            elif last is not None and t - last > f:
                out[c.client_id] = f"fairness floor: not chosen for {t - last - 1} rounds"
        return out

    def _choose(self, inp: SelectionInput) -> Choice:
        due = self.due(inp)
        inner = self.policy.select(dataclasses.replace(inp, must=tuple(due)))
        chosen, reasons = set(inner.chosen), dict(inner.reasons)
        added = sorted(set(due) - chosen)
        for cid in added:
            reasons[cid] = due[cid]
        chosen |= set(added)
        f = self.rounds(len(inp.alive()))
        floor = (f"fairness floor ({f} rounds): added {', '.join(added)}",) if added else ()
        memory = {**inner.memory, "chosen": sorted(chosen)} if "chosen" in inner.memory else inner.memory
        return Choice(chosen, reasons, inner.reasoning + floor, memory, inner.fallback_reason)


def make_policy(name: str = DEFAULT_POLICY, every_f_rounds: int | None = None, **params: Any) -> Policy:
    """The policy `name` with its parameters, under a `FairnessFloor` when every_f_rounds is given (0:
    the floor's automatic F).
    Raises ValueError saying what to change for an unknown name, a parameter the policy does not take,
    or a value it cannot work with. `make_policy(**policy.config())` rebuilds the same policy."""
    if name not in BY_NAME:
        raise ValueError(f"unknown selection policy {name!r}: use one of {', '.join(BY_NAME)}")
    known = tuple(inspect.signature(BY_NAME[name]).parameters)
    extra = sorted(set(params) - set(known))
    if extra:
        takes = ", ".join(known) or "no parameters"
        raise ValueError(f"selection policy {name!r} does not take {', '.join(extra)}: it takes {takes}")
    policy = BY_NAME[name](**params)
    return policy if every_f_rounds is None else FairnessFloor(policy, every_f_rounds)


@dataclasses.dataclass(frozen=True)
class SelectionSettings:
    """The aggregator's selection settings (--selector, --clients-per-round, --selection-fraction,
    --fairness-rounds); `policy()` is the policy they name. Zero means "not set", but for
    fairness_rounds, where 0 is the automatic floor (`FairnessFloor`), on by default for every selector
    but `all`, and NO_FLOOR (-1) turns it off."""

    selector: str = DEFAULT_POLICY
    clients_per_round: int = 0
    fraction: float = 0.0
    fairness_rounds: int = 0
    model: str = ""  # agent-llm's model ("" = the run's base model)

    @property
    def selective(self) -> bool:
        """Whether rounds take only the clients chosen (every policy but `all`, or `all` under a floor,
        which changes nothing and is refused)."""
        return self.selector != DEFAULT_POLICY

    def policy(self) -> Policy:
        """The policy; ValueError saying which flag to change where the settings do not fit it."""
        name = self.selector
        if name not in BY_NAME:
            raise ValueError(f"--selector {name!r} is unknown: use one of {', '.join(BY_NAME)}")
        takes = inspect.signature(BY_NAME[name]).parameters
        params: dict[str, Any] = {}
        for flag, key, value in (("--clients-per-round", "clients_per_round", self.clients_per_round),
                                 ("--selection-fraction", "fraction", self.fraction)):
            if value and key not in takes:
                raise ValueError(f"--selector {name} does not take {flag}: it chooses how many clients take part "
                                 "itself; leave the flag out, or use --selector sample or utility")
            if value:
                params[key] = value
        if {"clients_per_round", "fraction"} <= params.keys():
            raise ValueError("give one of --clients-per-round and --selection-fraction, not both")
        if self.model:
            if name != "agent-llm":
                raise ValueError(f"--selector-model is agent-llm's model; --selector {name} takes none: leave it out")
            params["model"] = self.model
        if not params and name in COUNTED:
            raise ValueError(f"--selector {name} needs --clients-per-round N or --selection-fraction F (how many "
                             "clients a round takes)")
        if self.fairness_rounds < NO_FLOOR:
            raise ValueError(f"--fairness-rounds must be -1 (no floor), 0 (the automatic floor: ceil(alive / "
                             f"places) + 1 rounds) or more, got {self.fairness_rounds}")
        if self.fairness_rounds > 0 and name == DEFAULT_POLICY:
            raise ValueError("--fairness-rounds with --selector all changes nothing: every alive client takes part "
                             "in every round; leave it out, or choose another selector")
        floor = None if name == DEFAULT_POLICY or self.fairness_rounds == NO_FLOOR else self.fairness_rounds
        return make_policy(name, floor, **params)

    def config(self) -> dict[str, Any]:
        """What the run's settings fingerprint keeps (a restart must not change who is chosen)."""
        return self.policy().config()


BY_NAME: dict[str, type[Policy]] = {p.name: p for p in (All, Sample, Available, Utility, *AGENTS)}
POLICIES: dict[str, str] = {name: p.description for name, p in BY_NAME.items()}
"""The policy names `make_policy` accepts, each with a one-line description."""
COUNTED = ("sample", "utility")  # the policies that must be told how many clients a round takes


def top_up(sel: Selection, inp: SelectionInput, gone: set[str]) -> Selection:
    """`sel` with each client of `gone` (chosen, not alive, no upload) replaced by an alive client not
    chosen, drawn as `sample` draws, as long as there are any: a chosen cohort that dies must not hold
    its round until the deadline (or for ever, short of min_clients) while others could take part. The
    clients already chosen keep their places, so uploads already accepted count; a gone client with
    no replacement keeps its place (it may come back). `sel` itself where nobody can be replaced."""
    pool = _draw(inp, "top-up", [c for c in inp.alive() if c.client_id not in sel.chosen])
    pairs = list(zip(sorted(gone), (c.client_id for c in pool)))
    if not pairs:
        return sel
    reasons = dict(sel.reasons)
    for dead, new in pairs:
        reasons[dead] = f"chosen, then not alive before it uploaded: replaced by {new}"
        reasons[new] = f"topped up: replaces {dead} (not alive)"
    chosen = (set(sel.chosen) - {d for d, _ in pairs}) | {n for _, n in pairs}
    step = "topped up: " + ", ".join(f"{new} for {dead}" for dead, new in pairs)
    return dataclasses.replace(sel, chosen=tuple(chosen), reasons=reasons, reasoning=(step, *sel.reasoning))
