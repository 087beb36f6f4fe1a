"""The types every selection policy shares (`selection` and `selector_agents` both build on them, so
they live here, importing neither): what a policy reads (ClientHistory, SelectionInput), what it
returns (Choice, Selection), the Policy base that checks the guarantees of `selection`'s doc on
every result, the count of places a round takes (_Count) and the seeded draw (_draw)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from typing import Any, Mapping


MAX_LOSS = 1e3  # a training loss above this is clipped to it (a causal LM's loss at uniform is ~ln(vocab), ~11)
MAX_BUFFER = 1_000_000  # successful trajectories a client could hold (it keeps a bounded buffer)
REPORTED_RANGES = (("last_success", 0.0, 1.0), ("success_gain", -1.0, 1.0), ("last_loss", 0.0, MAX_LOSS),
                   ("buffer_size", 0, MAX_BUFFER))
CLIPPED = ("last_loss", "buffer_size")


@dataclasses.dataclass(frozen=True)
class ClientHistory:
    """What the round keeper knows of one joined client when a round opens. Rounds are round numbers;
    the optional values are None until the client has reported or been measured. The reported ones
    (last_success, success_gain, last_loss, buffer_size) are range-checked here, and the round keeper
    passes only reports of rounds the client took part in (chosen and uploaded). last_success and
    buffer_size no policy reads yet: they are there for the reasons `fedse status` shows."""

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
        # Reported by the client, so untrusted: a value outside what it can be (NaN, infinite, a success
        # ratio outside [0, 1], a negative loss or buffer) says nothing, like no report; a loss or a
        # buffer beyond any plausible one is clipped (policies rank them anyway, see selection_utility).
        for name, low, high in REPORTED_RANGES:
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and low <= value):
                value = None
            elif value is not None and value > high:
                value = high if name in CLIPPED else None
            object.__setattr__(self, name, value if name != "buffer_size" or value is None else int(value))
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
    must: tuple[str, ...] = ()  # clients the fairness floor adds this round (an agent's answer must name them)

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
        object.__setattr__(self, "must", tuple(sorted(str(c) for c in self.must)))

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
