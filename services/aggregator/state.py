"""The run's persisted state: the settings that decide its result, the adapter schema and base model
the first join fixed, the joined clients, and where the run stands (round, state, round nonce,
deadline, durations of the rounds done).

`RunState` is what run.json holds (`to_dict`, `restore`), plus, for each joined client, a `Member`
with what is not persisted: when it was last heard from, the upload under way and its latest
metrics. The round keeper changes it under its lock.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
from typing import Any, Callable

from fedse.privacy import accounting
from fedse.model import adapter as ad
from fedse.model import ranks
from fedse.transport.inputs import shown
from fedse.transport.serving import log_fields

from .errors import NotJoined, NotSelected
from .selection.policies import Selection, SelectionSettings
from .store import Store, config_with_base
from .strategies import BY_NAME, StrategyParams
from .uploads import Accepted, Stream

log = logging.getLogger("aggregator.rounds")

STATE_VERSION = 1


class State(enum.Enum):
    WAITING_FOR_CLIENTS = "waiting_for_clients"
    OPEN = "open"
    AGGREGATING = "aggregating"
    FINISHED = "finished"


@dataclasses.dataclass(frozen=True)
class RunSettings:
    run_id: str
    num_rounds: int
    min_clients: int
    round_deadline_s: float
    strategy: str
    max_adapter_bytes: int
    seed: int = 0
    wait_after_min_s: float = 900.0
    heartbeat_timeout_s: float = 30.0
    heartbeat_interval_s: float = 5.0
    params: StrategyParams = StrategyParams()
    start_clients: int = 0  # clients that open round 0 (0 = min_clients)
    secure: bool = False  # secure aggregation: uploads are masked vectors
    secure_threshold: int = 0  # shares that rebuild a seed (0 = a majority of a neighbourhood)
    secure_neighbours: int = 0  # each client's neighbours (0 = everyone)
    secure_stage_timeout_s: float = 120.0
    secure_ca: str = ""  # the federation CA's PEM file (mTLS): clients sign their keys and the uploader list
    secure_max_roster: int = 1024  # the most members of an attempt's roster
    dp_delta: float = 1e-5  # the delta of the (epsilon, delta) reported
    selection: SelectionSettings = SelectionSettings()  # who takes part in each round
    # Asynchronous buffered rounds (FedBuff): `round` counts global versions; at most
    # async_concurrency clients train at once (0: every joined client), every async_buffer uploads
    # (0: async_concurrency's) fold into the next version, and an upload trained from a version more
    # than async_max_staleness behind is refused. A fold adds async_server_lr (eta_g) times the buffer's
    # staleness-weighted mean update to the version (1: the mean update itself).
    mode: str = "sync"
    async_concurrency: int = 0
    async_buffer: int = 0
    async_max_staleness: int = 8
    async_server_lr: float = 1.0
    # Mixed LoRA ranks: clients train any rank up to this, and the run's adapter is at it (0: every
    # client trains the first one's rank).
    max_lora_rank: int = 0

    @property
    def asynchronous(self) -> bool:
        return self.mode == "async"

    @property
    def secure_signed(self) -> bool:
        """Secure aggregation with signed keys and the consistency stage (RunConfig.secure_signed)."""
        return self.secure and bool(self.secure_ca)

    def fingerprint(self) -> dict[str, Any]:
        """The settings that decide a run's result: a restart must not change them."""
        out = {"num_rounds": self.num_rounds, "strategy": self.strategy, "seed": self.seed,
               "params": dataclasses.asdict(self.params)}
        if self.secure:
            out["secure"] = True
        if self.selection.selective:
            out["selection"] = self.selection.config()
        if self.max_lora_rank:
            out["max_lora_rank"] = self.max_lora_rank
        if self.asynchronous:
            out["async"] = {"concurrency": self.async_concurrency, "buffer": self.async_buffer,
                            "max_staleness": self.async_max_staleness}
            if self.async_server_lr != 1.0:  # runs saved before it existed resume with the default
                out["async"]["server_lr"] = self.async_server_lr
        return out

    def dp_epsilons(self, releases: int) -> tuple[float, float] | None:
        """(epsilon of one round, epsilon of `releases` rounds) at dp_delta (fedse.privacy.accounting), or None
        when the run is not differentially private: without clipping and noise nothing bounds a client's
        influence on what is published, and the noise is calibrated for fedavg's mean alone."""
        if self.params.clip_norm <= 0 or self.params.noise_multiplier <= 0 or not BY_NAME[self.strategy].noise_calibrated:
            return None
        return accounting.epsilons(self.params.noise_multiplier, releases, self.dp_delta)


@dataclasses.dataclass(frozen=True)
class Client:
    client_id: str
    env: str
    base_model: str


@dataclasses.dataclass
class Member:
    """A joined client and its part in the run: when it was last heard from and what it said it was
    doing, its upload of the open round (a stream receiving it, then the accepted upload) and its
    latest metrics."""

    client: Client
    last_seen: float = 0.0
    phase_round: int = -1
    phase: str = ""
    stream: Stream | None = None  # receiving its upload now
    accepted: Accepted | None = None  # its upload of the open round, accepted
    metrics_round: int = -1
    metrics: dict[str, float] = dataclasses.field(default_factory=dict)
    previous_success: float | None = None  # the held-out success it reported before its latest
    # Its part in the run so far (persisted; what a selector reads): the rounds it was selected for
    # (selective runs only), the rounds whose upload was accepted and how long after the round opened
    # (the latest UPLOAD_TIMES), and the rounds it was selected for and did not upload.
    rounds_selected: list[int] = dataclasses.field(default_factory=list)
    rounds_uploaded: list[int] = dataclasses.field(default_factory=list)
    upload_seconds: list[float] = dataclasses.field(default_factory=list)
    dropouts: int = 0
    # Asynchronous rounds: since when it holds a training slot (None: it holds none) and the latest
    # version it was given a slot for (it trains from a version once).
    slot_since: float | None = None
    slot_version: int = -1
    slot_lost: int = -1  # the version at which its slot was last taken back at its deadline (not persisted)
    # Its LoRA, as its Join said: rank and scaling (lora_alpha / r), which the mixed-rank strategies weigh.
    lora_rank: int = 0
    lora_scaling: float = 1.0

    def new_round(self) -> None:
        self.stream = self.accepted = None

    def record(self) -> dict[str, Any]:
        """What run.json keeps of it."""
        out = {"env": self.client.env, "base_model": self.client.base_model,
               "rounds_selected": self.rounds_selected, "rounds_uploaded": self.rounds_uploaded,
               "upload_seconds": self.upload_seconds, "dropouts": self.dropouts,
               "lora_rank": self.lora_rank, "lora_scaling": self.lora_scaling}
        if self.slot_version >= 0:
            out.update(slot=self.slot_since is not None, slot_version=self.slot_version)
        return out


UPLOAD_TIMES = 16  # the upload durations a member's record keeps


@dataclasses.dataclass
class RunState:
    """Where the run stands; everything but the members' liveness, streams and metrics is persisted."""

    schema: ad.Schema | None = None
    base_model: str | None = None
    members: dict[str, Member] = dataclasses.field(default_factory=dict)
    round: int = 0
    state: State = State.WAITING_FOR_CLIENTS
    nonce: str = ""
    deadline: float = 0.0
    opened_at: float = 0.0
    round_seconds: list[float] = dataclasses.field(default_factory=list)
    # Secure aggregation: the round whose masks the aggregator began to remove (-1: none). Saved before
    # the sum is unmasked: that round never starts another attempt, even after a restart.
    released: int = -1
    # Selective runs: the open round's selection, the selector's memory (an agent's, carried from round to
    # round) and how often the selector's answer was replaced by its fallback.
    selection: Selection | None = None
    selector_memory: dict[str, Any] = dataclasses.field(default_factory=dict)
    selector_fallbacks: int = 0

    def selected(self, client_id: str) -> bool:
        """Whether the client takes part in the open round (every client does in a run without selection)."""
        return self.selection is None or client_id in self.selection.chosen

    def selection_reason(self, client_id: str) -> str:
        """Why the client is or is not in the open round's selection."""
        if self.selection is None:
            return "every client takes part"
        return self.selection.reasons.get(client_id, f"joined after round {self.selection.round}'s selection")

    def check_selected(self, client_id: str) -> None:
        """Raises NotSelected, saying why, unless the client takes part in the open round."""
        if not self.selected(client_id):
            raise NotSelected(f"client {client_id} does not take part in round {self.round} "
                              f"({self.selection_reason(client_id)}): wait for a later round; RoundStatus.selected "
                              "names the clients of each round")

    def member(self, client_id: str) -> Member:
        """The joined client's Member; NotJoined if it has not joined."""
        m = self.members.get(client_id)
        if m is None:
            raise NotJoined(f"client {shown(client_id)} has not joined this run: call Join first")
        return m

    def uploaded(self) -> dict[str, Member]:
        """The members whose upload of the open round is accepted, by client id (sorted)."""
        return {cid: m for cid, m in sorted(self.members.items()) if m.accepted is not None}

    def member_schema(self, client_id: str) -> ad.Schema:
        """The schema of the client's uploads: the run's, at the client's own rank in a mixed-rank run."""
        assert self.schema is not None
        m = self.members.get(client_id)
        if m is None or not m.lora_rank or m.lora_rank == ranks.rank_or_zero(self.schema):
            return self.schema
        return ranks.at_rank(self.schema, m.lora_rank, m.lora_rank)

    def adapter_config(self) -> str:
        """The run's adapter_config.json, naming its base model (what every global adapter carries)."""
        assert self.schema is not None
        return config_with_base(self.schema.adapter_config_json, self.base_model or "")

    def to_dict(self, settings: RunSettings) -> dict[str, Any]:
        """run.json's content (a round being aggregated is saved as open: a restart aggregates it again)."""
        return {
            "version": STATE_VERSION, "run_id": settings.run_id, "settings": settings.fingerprint(),
            "schema": self.schema.to_dict() if self.schema else None, "base_model": self.base_model,
            "clients": {cid: m.record() for cid, m in self.members.items()},
            "round": self.round, "state": self.state.value if self.state is not State.AGGREGATING else "open",
            "round_nonce": self.nonce, "deadline_unix": self.deadline, "opened_unix": self.opened_at,
            "round_seconds": self.round_seconds, "released_round": self.released,
            "selection": self.selection.to_dict() if self.selection is not None else None,
            "selector_memory": self.selector_memory, "selector_fallbacks": self.selector_fallbacks,
        }


def restore(settings: RunSettings, store: Store, now: float,
            open_uploads: Callable[[RunSettings, Store, int], dict[str, Accepted]]) -> RunState:
    """The run the store holds (with the accepted uploads of its open round, as `open_uploads`, the run's
    schedule's, reads them), or a new one. A run saved with other settings that decide its result is
    refused (ValueError saying what to do)."""
    saved = store.load_state()
    if saved is None:
        return RunState()
    if saved.get("settings") != settings.fingerprint():
        raise ValueError(
            f"the state directory {store.root} holds run {settings.run_id!r} with settings "
            f"{saved.get('settings')}, not {settings.fingerprint()}: restart with the same settings "
            "to resume it, or give a new --run-id")
    run = RunState(
        schema=ad.Schema.from_dict(saved["schema"]) if saved.get("schema") else None,
        base_model=saved.get("base_model"),
        # A restart is not the clients' fault: everyone known counts as alive until proven otherwise.
        members={cid: Member(Client(cid, c["env"], c["base_model"]), last_seen=now,
                             rounds_selected=[int(r) for r in c.get("rounds_selected", [])],
                             rounds_uploaded=[int(r) for r in c.get("rounds_uploaded", [])],
                             upload_seconds=[float(x) for x in c.get("upload_seconds", [])],
                             dropouts=int(c.get("dropouts", 0)),
                             slot_since=now if c.get("slot") else None, slot_version=int(c.get("slot_version", -1)),
                             lora_rank=int(c.get("lora_rank", 0)), lora_scaling=float(c.get("lora_scaling", 1.0)))
                 for cid, c in saved["clients"].items()},
        round=int(saved["round"]), state=State(saved["state"]), nonce=saved.get("round_nonce", ""),
        deadline=float(saved.get("deadline_unix", 0.0)), opened_at=float(saved.get("opened_unix", now)),
        round_seconds=list(saved.get("round_seconds", [])), released=int(saved.get("released_round", -1)),
        selection=Selection.from_dict(saved["selection"]) if saved.get("selection") else None,
        selector_memory=dict(saved.get("selector_memory") or {}),
        selector_fallbacks=int(saved.get("selector_fallbacks", 0)))
    if run.state is State.OPEN:
        for cid, accepted in open_uploads(settings, store, run.round).items():
            run.members[cid].accepted = accepted
    log.info("run resumed", extra=log_fields(run_id=settings.run_id, round=run.round, state=run.state.value,
                                             clients=len(run.members), uploads=len(run.uploaded())))
    return run

