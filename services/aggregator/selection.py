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
  Guided Participant Selection"): the top K(1 - epsilon) clients by statistical utility times a
  system factor, and the other epsilon K slots for clients never tried (see `Utility`).
- agent-tools, agent-llm: selector agents that decide K too, with their reasoning and memory
  (`selector_agents`).

Any of them can be wrapped in `FairnessFloor` (`every_f_rounds`), which adds every alive client left
out for F rounds, so that no organisation is starved by sampling or by a low utility.

Guarantees, checked on every selection whatever the policy: no client that is not alive is chosen;
at least one client is chosen whenever at least one is alive; every client of the input, chosen or
not, has a short reason (what `fedse status` would show).
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import json
import math
import statistics
from typing import Any, Mapping

DEFAULT_POLICY = "all"


@dataclasses.dataclass(frozen=True)
class ClientHistory:
    """What the round keeper knows of one joined client when a round opens. Rounds are round numbers;
    the optional values are None until the client has reported or been measured. last_success,
    dropouts and buffer_size no policy reads yet: they are there for the reasons `fedse status` shows
    and for policies to come, so that adding one changes no input."""

    client_id: str
    alive: bool                        # heard from within the heartbeat timeout
    heartbeat_age_s: float             # seconds since it was last heard from
    rounds_selected: tuple[int, ...] = ()
    rounds_uploaded: tuple[int, ...] = ()  # rounds whose upload was accepted
    last_success: float | None = None  # latest held-out success ratio it reported
    success_gain: float | None = None  # latest change of that ratio
    last_loss: float | None = None     # latest training loss it reported
    mean_round_s: float | None = None  # its mean time from round open to accepted upload
    dropouts: int = 0                  # rounds it was selected for and did not upload
    buffer_size: int | None = None     # successful trajectories it holds

    def __post_init__(self) -> None:
        # Tuples, also when built from JSON lists: the dataclass stays hashable and comparable.
        object.__setattr__(self, "rounds_selected", tuple(int(r) for r in self.rounds_selected))
        object.__setattr__(self, "rounds_uploaded", tuple(int(r) for r in self.rounds_uploaded))
        # Reported by the client, so untrusted: a NaN or infinite value says nothing, like no report.
        for name in ("last_success", "success_gain", "last_loss"):
            value = getattr(self, name)
            if value is not None and not math.isfinite(value):
                object.__setattr__(self, name, None)
        if not isinstance(self.client_id, str) or not self.client_id:
            raise ValueError(f"client_id must be a non-empty string, got {self.client_id!r}")
        if math.isnan(self.heartbeat_age_s) or self.heartbeat_age_s < 0:
            raise ValueError(f"client {self.client_id}: heartbeat_age_s must be >= 0, got {self.heartbeat_age_s}")
        if self.mean_round_s is not None and not (math.isfinite(self.mean_round_s) and self.mean_round_s > 0):
            raise ValueError(f"client {self.client_id}: mean_round_s must be a finite number > 0 or None "
                             f"(never measured), got {self.mean_round_s}")

    @property
    def tried(self) -> bool:
        """Whether it has ever been selected, uploaded or reported anything (Oort explores the others)."""
        return bool(self.rounds_selected or self.rounds_uploaded) or any(
            v is not None for v in (self.last_success, self.success_gain, self.last_loss))


@dataclasses.dataclass(frozen=True)
class SelectionInput:
    """Everything a policy may read. `clients` may come in any order: they are kept sorted by id."""

    run_id: str
    round: int
    seed: int
    clients: tuple[ClientHistory, ...]
    minimum: int = 1  # the fewest clients the round needs (min_clients; 2 with secure aggregation)
    memory: Mapping[str, Any] = dataclasses.field(default_factory=dict)  # what an agent kept (JSON types)
    base_model: str = ""  # the run's base model (what agent-llm reasons with unless given another)

    def __post_init__(self) -> None:
        if not _integer(self.minimum) or self.minimum < 1:
            raise ValueError(f"minimum must be an integer >= 1, got {self.minimum!r}")
        clients = tuple(sorted(self.clients, key=lambda c: c.client_id))
        ids = [c.client_id for c in clients]
        twice = sorted({i for i in ids if ids.count(i) > 1})
        if twice:
            raise ValueError(f"client ids must be unique in a selection input, got {', '.join(twice)} twice")
        if self.round < 0:
            raise ValueError(f"round must be >= 0, got {self.round}")
        object.__setattr__(self, "clients", clients)

    def alive(self) -> list[ClientHistory]:
        return [c for c in self.clients if c.alive]


@dataclasses.dataclass(frozen=True)
class Selection:
    """Who takes part in `round` (sorted ids) and why each client of the input is in or out."""

    round: int
    chosen: tuple[str, ...]
    reasons: dict[str, str]
    policy: str
    reasoning: tuple[str, ...] = ()  # an agent's steps, one a line (what `fedse status` shows)
    memory: Mapping[str, Any] = dataclasses.field(default_factory=dict)  # an agent's memory after it
    fallback_reason: str = ""  # why the selector's own answer was replaced ("" when it was used)

    def __post_init__(self) -> None:
        object.__setattr__(self, "chosen", tuple(sorted(self.chosen)))
        object.__setattr__(self, "reasoning", tuple(str(r) for r in self.reasoning))
        missing = sorted(set(self.chosen) - set(self.reasons))
        if missing:
            raise ValueError(f"selection of round {self.round}: no reason for chosen client(s) {', '.join(missing)}")

    def to_dict(self) -> dict[str, Any]:
        """The run state's record of it (JSON types only)."""
        out = {"round": self.round, "policy": self.policy, "chosen": list(self.chosen),
               "reasons": dict(sorted(self.reasons.items()))}
        if self.reasoning:
            out["reasoning"] = list(self.reasoning)
        if self.memory:
            out["memory"] = dict(self.memory)
        if self.fallback_reason:
            out["fallback_reason"] = self.fallback_reason
        return out

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Selection:
        return cls(round=int(d["round"]), chosen=tuple(str(c) for c in d["chosen"]),
                   reasons={str(k): str(v) for k, v in d["reasons"].items()}, policy=str(d["policy"]),
                   reasoning=tuple(d.get("reasoning", ())), memory=dict(d.get("memory", {})),
                   fallback_reason=str(d.get("fallback_reason", "")))


@dataclasses.dataclass
class Choice:
    """What a policy's `_choose` returns: who and why, and for an agent its reasoning, its memory after
    this round and, where its own answer was not used, why (a fallback)."""

    chosen: set[str]
    reasons: dict[str, str]
    reasoning: tuple[str, ...] = ()
    memory: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    fallback_reason: str = ""


class Policy:
    """One selection policy. Subclasses say who they choose and why (`_choose`); `select` checks the
    guarantees of the module doc on every result, so a policy cannot break them by mistake."""

    name = ""
    description = ""  # one line, for --help and the docs

    def select(self, inp: SelectionInput) -> Selection:
        out = self._choose(inp)
        choice = out if isinstance(out, Choice) else Choice(*out)
        chosen, reasons = choice.chosen, choice.reasons
        alive = {c.client_id for c in inp.alive()}
        if not chosen <= alive:
            raise RuntimeError(f"policy {self.name} chose client(s) not alive: {', '.join(sorted(chosen - alive))}")
        if alive and not chosen:
            raise RuntimeError(f"policy {self.name} chose no client of the {len(alive)} alive")
        unexplained = sorted({c.client_id for c in inp.clients} - set(reasons))
        if unexplained:
            raise RuntimeError(f"policy {self.name} gave no reason for {', '.join(unexplained)}")
        chosen, reasons = set(chosen), dict(reasons)
        need = min(inp.minimum, len(alive))
        for c in _draw(inp, "minimum", [c for c in inp.alive() if c.client_id not in chosen])[:max(0, need - len(chosen))]:
            chosen.add(c.client_id)  # the round could not close with fewer
            reasons[c.client_id] = f"added: the round needs {inp.minimum} clients ({reasons[c.client_id]})"
        return Selection(inp.round, tuple(chosen), {c.client_id: reasons[c.client_id] for c in inp.clients},
                         self.name, choice.reasoning, choice.memory, choice.fallback_reason)

    def config(self) -> dict[str, Any]:
        """Its name and parameters, as `make_policy` takes them back (for the run's settings fingerprint)."""
        return {"name": self.name}

    def _choose(self, inp: SelectionInput) -> tuple[set[str], dict[str, str]] | Choice:
        raise NotImplementedError


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


class Utility(Policy):
    """Oort's guided selection, adapted to what Fed-SE clients report.

    Statistical utility: the client's latest success gain if it reported one (clipped to [0, 1], a
    change of a ratio; a client whose held-out success rose learns from this federation), else its latest training loss (Oort's
    signal: a high loss leaves more to learn), else unknown. Success shares and losses of different
    environments are not on one scale, so each signal is divided by its largest value among the alive
    clients reporting it: the best client by each signal scores 1.0.

    System factor: with T the median of the known mean_round_s of alive clients, a client slower than
    T (duration d > T) is scaled by (T/d)^alpha; a client never measured is not scaled.

    K clients are chosen (clients_per_round, or ceil(fraction * alive)): the top K - E tried clients
    by utility (unknown utility last, ties in a seeded order), and E = round(epsilon * K) (half up)
    clients never tried, drawn as `sample` draws. When one group is short, the other fills its slots.
    """

    name = "utility"
    description = "Oort: top clients by success gain (else loss) times a speed factor, epsilon explores untried ones"

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
        """Each alive tried client's utility (None: unknown) and what scaled it, by client id."""
        alive = inp.alive()
        top_gain = max((c.success_gain for c in alive if c.success_gain is not None), default=0.0)
        top_loss = max((c.last_loss for c in alive if c.last_loss is not None), default=0.0)
        durations = [c.mean_round_s for c in alive if c.mean_round_s is not None]
        preferred = statistics.median(durations) if durations else None
        out: dict[str, tuple[float | None, str]] = {}
        for c in alive:
            if not c.tried:
                continue
            if c.success_gain is not None:  # a change of a ratio: at most 1, whatever a client claims
                stat = min(max(c.success_gain, 0.0), 1.0) / min(top_gain, 1.0) if top_gain > 0 else 0.0
            elif c.last_loss is not None:
                stat = max(c.last_loss, 0.0) / top_loss if top_loss > 0 else 0.0
            else:
                out[c.client_id] = (None, "")
                continue
            note = ""
            if preferred is not None and c.mean_round_s is not None and c.mean_round_s > preferred:
                stat *= (preferred / c.mean_round_s) ** self.alpha
                note = f" (slow: {c.mean_round_s:.0f} s, median {preferred:.0f} s)"
            out[c.client_id] = (stat, note)
        return out

    def _choose(self, inp: SelectionInput) -> tuple[set[str], dict[str, str]]:
        alive = inp.alive()
        k = self.count.of(len(alive))
        utility = self.utilities(inp)
        order = {c.client_id: i for i, c in enumerate(_draw(inp, "utility-ties", alive))}
        tried = sorted(utility, key=lambda cid: (utility[cid][0] is None, -(utility[cid][0] or 0.0), order[cid]))
        fresh = [c.client_id for c in _draw(inp, "utility-explore", [c for c in alive if not c.tried])]
        explore = min(math.floor(self.epsilon * k + 0.5), len(fresh))
        exploit = min(k - explore, len(tried))
        explore = min(k - exploit, len(fresh))
        chosen = set(tried[:exploit]) | set(fresh[:explore])
        reasons = {}
        for c in inp.clients:
            cid = c.client_id
            if not c.alive:
                reasons[cid] = _dead(c)
            elif cid in utility:
                value, note = utility[cid]
                shown = "unknown (nothing reported)" if value is None else f"{value:.2f}{note}"
                reasons[cid] = f"utility {shown}, rank {tried.index(cid) + 1} of {len(tried)}; top {exploit} taken"
            elif cid in chosen:
                reasons[cid] = "exploring: never tried"
            else:
                reasons[cid] = f"never tried, not drawn to explore ({explore} of {len(fresh)} taken)"
        return chosen, reasons


class FairnessFloor(Policy):
    """Another policy, plus every alive client not selected in the last F rounds (rounds t-F .. t-1), or
    never selected once round F is reached: sampling or a low utility must not shut an organisation
    out of the federation for good. With F = 1 no alive client sits out two rounds in a row."""

    def __init__(self, policy: Policy, every_f_rounds: int) -> None:
        if isinstance(policy, FairnessFloor):
            raise ValueError("the policy is already under a fairness floor: wrap it once")
        if not _integer(every_f_rounds) or every_f_rounds < 1:
            raise ValueError(f"every_f_rounds must be an integer >= 1, got {every_f_rounds!r}: an alive client "
                             "left out that many rounds in a row is added; use e.g. 5")
        self.policy, self.every_f_rounds = policy, int(every_f_rounds)
        self.name = f"{policy.name}+fairness_floor"
        self.description = f"{policy.description}; plus anyone left out for every_f_rounds"

    def config(self) -> dict[str, Any]:
        return {**self.policy.config(), "every_f_rounds": self.every_f_rounds}

    def _choose(self, inp: SelectionInput) -> Choice:
        inner = self.policy.select(inp)
        chosen, reasons = set(inner.chosen), dict(inner.reasons)
        added = []
        f, t = self.every_f_rounds, inp.round
        for c in inp.alive():
            if c.client_id in chosen:
                continue
            last = max((r for r in c.rounds_selected if r < t), default=None)
            if last is None and t >= f:
                reasons[c.client_id] = f"fairness floor: never chosen in {t} rounds"
            elif last is not None and t - last > f:
                reasons[c.client_id] = f"fairness floor: not chosen for {t - last - 1} rounds"
            else:
                continue
            chosen.add(c.client_id)
            added.append(c.client_id)
        floor = (f"fairness floor ({f} rounds): added {', '.join(added)}",) if added else ()
        return Choice(chosen, reasons, inner.reasoning + floor, inner.memory, inner.fallback_reason)


def make_policy(name: str = DEFAULT_POLICY, every_f_rounds: int | None = None, **params: Any) -> Policy:
    """The policy `name` with its parameters, under a `FairnessFloor` when every_f_rounds is given.
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
    --fairness-rounds); `policy()` is the policy they name. Zero means "not set"."""

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
        if self.fairness_rounds < 0:
            raise ValueError(f"--fairness-rounds must be 0 (no floor) or more, got {self.fairness_rounds}")
        if self.fairness_rounds and name == DEFAULT_POLICY:
            raise ValueError("--fairness-rounds with --selector all changes nothing: every alive client takes part "
                             "in every round; leave it out, or choose another selector")
        return make_policy(name, self.fairness_rounds or None, **params)

    def config(self) -> dict[str, Any]:
        """What the run's settings fingerprint keeps (a restart must not change who is chosen)."""
        return self.policy().config()


# ---- internals ---------------------------------------------------------------------------------

class _Count:
    """How many clients a round takes: exactly one of clients_per_round (M) and fraction (of the alive)."""

    def __init__(self, policy: str, clients_per_round: int | None, fraction: float | None) -> None:
        if (clients_per_round is None) == (fraction is None):
            raise ValueError(f"selection policy {policy!r} needs exactly one of clients_per_round (how many "
                             "clients a round takes) and fraction (which share of the alive clients)")
        if clients_per_round is not None and (not _integer(clients_per_round) or clients_per_round < 1):
            raise ValueError(f"clients_per_round must be an integer >= 1, got {clients_per_round!r}")
        if fraction is not None and (not _number(fraction) or not 0.0 < fraction <= 1.0):
            raise ValueError(f"fraction must be in (0, 1] (the share of alive clients a round takes; "
                             f"1 takes them all), got {fraction!r}")
        self.clients_per_round = None if clients_per_round is None else int(clients_per_round)
        self.fraction = None if fraction is None else float(fraction)

    def config(self) -> dict[str, Any]:
        if self.clients_per_round is not None:
            return {"clients_per_round": self.clients_per_round}
        return {"fraction": self.fraction}

    def of(self, alive: int) -> int:
        """Clients to take out of `alive` (all of them when fewer); at least one when any is alive."""
        if self.clients_per_round is not None:
            return min(self.clients_per_round, alive)
        # The epsilon keeps e.g. 0.3 * 10 from rounding up to 4 on a float error.
        return min(alive, max(1, math.ceil(self.fraction * alive - 1e-9)))


def _draw(inp: SelectionInput, purpose: str, clients: list[ClientHistory]) -> list[ClientHistory]:
    """`clients` in a random order fixed by (purpose, seed, run_id, round): each client's key is a SHA-256
    of those and its id, so the order depends neither on the input's order nor on who else is in it,
    and does not rely on `random`'s algorithms staying the same across Python versions."""
    def key(c: ClientHistory) -> tuple[bytes, str]:
        text = json.dumps(["fedse-selection", purpose, inp.seed, inp.run_id, inp.round, c.client_id])
        return hashlib.sha256(text.encode()).digest(), c.client_id
    return sorted(clients, key=key)


def _age(c: ClientHistory) -> str:
    return "never heard" if math.isinf(c.heartbeat_age_s) else f"{c.heartbeat_age_s:.0f} s"


def _dead(c: ClientHistory) -> str:
    return f"not alive (heard {_age(c)} ago)" if math.isfinite(c.heartbeat_age_s) else "not alive (never heard)"


def _integer(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and not math.isnan(x)


# The registry, last: the agents (selector_agents) build on the policies above.
from .selector_agents import AGENTS  # noqa: E402

BY_NAME: dict[str, type[Policy]] = {p.name: p for p in (All, Sample, Available, Utility, *AGENTS)}
POLICIES: dict[str, str] = {name: p.description for name, p in BY_NAME.items()}
"""The policy names `make_policy` accepts, each with a one-line description."""
COUNTED = ("sample", "utility")  # the policies that must be told how many clients a round takes
