"""Aggregator configuration and server construction (separate from serving, so tests bind port 0)."""

from __future__ import annotations

import dataclasses
import logging
import math
import pathlib
import sys
import threading

from fedse.config import ConfigError, field, parse_or_exit
from fedse.privacy.fixedpoint import MAX_CLIENTS
from fedse.privacy import secagg
from fedse.privacy.secagg import STRATEGIES as SECURE_STRATEGIES
from fedse.security.admission import Security, peer_identity, server_credentials, server_interceptors, shown_for
from fedse.transport.serving import Service, log_fields, setup_logging, start_metrics
from fedse.v1 import federation_pb2_grpc as fpb_grpc

from .rounds import RoundKeeper
from .schedules import SCHEDULES, schedule_for
from .selection.thinking import model_agent
from .selection.policies import POLICIES, SelectionSettings
from .servicer import FederationServicer
from .state import RunSettings
from .store import Store
from .tracking import Target, Tracker, check_installed, read_run_settings
from .strategies import BY_NAME, STRATEGIES, StrategyParams, validate_params


# Worker threads: every client holds a WatchRound stream (one thread each) while it waits for a round,
# so a pool smaller than the federation leaves joins, uploads and heartbeats queued behind the watchers
# for good. Room for as many clients as a fixed-point sum holds, and their calls; made as needed.
WORKERS = MAX_CLIENTS + 64


@dataclasses.dataclass(frozen=True)
class AggregatorConfig(Security):
    """The Fed-SE aggregator: rounds over LoRA adapters, synchronous or buffered asynchronous."""

    address: str = field("0.0.0.0:50060", "gRPC listen address (port 0 picks a free port)")
    metrics_port: int = field(9100, "Prometheus /metrics port (0 picks one, -1 disables)")
    run_id: str = field("fedse-run", "name of the run; files go under <state-dir>/<run-id>/")
    state_dir: str = field("state/aggregator", "directory for global adapters, uploads and metrics")
    rounds: int = field(5, "number of federated rounds T", old="num_rounds")
    min_clients: int = field(1, "clients needed to open round 0 (unless --start-clients), and uploads needed to close "
                                 "a round early")
    start_clients: int = field(0, "clients needed to open round 0 (0 = min-clients); set above min-clients, round 0 "
                                  "waits for every client while later rounds can close without one that died")
    round_deadline_s: float = field(3600.0, "seconds after which a round closes if at least min-clients uploaded "
                                            "(extended while an upload is making progress); --mode async: a "
                                            "version's buffer folds, and a slot held without an upload is taken back")
    wait_after_min_s: float = field(900.0, "once min-clients have uploaded, close the round this many seconds "
                                           "later at the latest")
    heartbeat_timeout_s: float = field(30.0, "a client not heard from for this long counts as not alive; a round "
                                             "does not wait for such clients once min-clients have uploaded")
    heartbeat_interval_s: float = field(5.0, "seconds between the heartbeats clients are asked to send")
    strategy: str = field("fedavg", f"aggregation strategy: {', '.join(STRATEGIES)}")
    trim_fraction: float = field(0.2, "trimmed_mean: fraction of clients cut from each end, per coordinate")
    clip_norm: float = field(0.0, "clip each client's update (its adapter minus the round's global one) to this "
                                  "L2 norm before aggregating; 0 = off")
    noise_multiplier: float = field(0.0, "differential privacy: Gaussian noise of std noise-multiplier * clip-norm "
                                         "on the sum of the updates (central: added to the aggregate; with "
                                         "secure-aggregation each client adds its part); needs clip-norm")
    secure_aggregation: bool = field(False, "secure aggregation: clients upload masked adapters and the aggregator "
                                            "learns only their mean (strategies fedavg and weighted; a round "
                                            "needs 2 clients or more; run it over mTLS, which says who takes part)")
    secure_threshold: int = field(0, "secure aggregation: clients whose shares rebuild a dropped client's masks, "
                                     "the fewest that may finish a round (0 = a majority of those who advertised "
                                     "keys, more than two thirds over mTLS; never below a majority, which "
                                     "clients refuse; at least 2)")
    secure_neighbours: int = field(0, "secure aggregation: each client's neighbours, with whom it shares seeds "
                                      "and masks (0 = everyone); for large federations (e.g. 40 for 1,000 "
                                      "clients), the threshold then counts among neighbours")
    secure_stage_timeout_s: float = field(120.0, "secure aggregation: how long the sharing, upload and unmasking "
                                                 "stages wait for clients that are alive")
    secure_max_roster: int = field(1024, "secure aggregation: the most clients in an attempt's roster (at most "
                                         "1024); key advertisement closes once this many advertised")
    secure_dropout_rate: float = field(0.05, "secure aggregation: the share of clients expected to drop out of a "
                                             "stage, which sizes the least --secure-neighbours for "
                                             "--secure-max-roster (a sparser ring would split often)")
    dp_delta: float = field(1e-5, "differential privacy: the delta of the (epsilon, delta) reported per round "
                                  "and in total (with --clip-norm and --noise-multiplier)")
    selector: str = field("all", "who takes part in each round: " + "; ".join(
        f"{name}: {text}" for name, text in POLICIES.items()))
    clients_per_round: int = field(0, "clients a round takes, for --selector sample or utility (0 = use "
                                      "--selection-fraction)")
    selection_fraction: float = field(0.0, "the share of alive clients a round takes, for --selector sample or "
                                           "utility (0 = use --clients-per-round)")
    fairness_rounds: int = field(0, "with a selector other than all: every alive client takes part at least once "
                                    "every this many rounds (0 = automatic, ceil(alive / places) + 1; -1 = no floor)")
    selector_model: str = field("", "--selector agent-llm: the model it asks, 'fedse-tiny' or a local Hugging Face "
                                    "model directory (empty = the run's base model)")
    mode: str = field("sync", "'sync' (rounds: every selected client from one global adapter) or 'async' (FedBuff: "
                              "clients train when they can, and every --async-buffer uploads fold into a new "
                              "version, stale ones weighted down; --rounds counts versions)")
    async_concurrency: int = field(0, "--mode async: clients training at once (0 = every joined client)")
    async_buffer: int = field(0, "--mode async: uploads folded into each new version (0 = --async-concurrency's, "
                                 "else every joined client)")
    async_max_staleness: int = field(8, "--mode async: the most versions behind an upload may be trained from; "
                                        "a staler one is refused and its client trains again from the newest")
    async_server_lr: float = field(1.0, "--mode async: FedBuff's server learning rate eta_g; a fold adds eta_g times "
                                        "the buffer's staleness-weighted mean update to the version (1 = the mean "
                                        "update itself)")
    max_lora_rank: int = field(0, "mixed LoRA ranks: each client trains its own --lora-r (and --lora-alpha) up to this "
                                  "rank, the run's adapter is held at it, and --strategy must be hlora, flexlora or "
                                  "zero-pad (0 = every client trains the first one's rank)")
    track: tuple[str, ...] = field((), "send each round's metrics (every client's and their mean) and the run's "
                                       "settings to TensorBoard, MLflow or W&B: tensorboard:DIR, mlflow:URI (a "
                                       "server, sqlite:///FILE, or a local path: an SQLite database, PATH if it "
                                       "ends in .db, else PATH/mlflow.db) or wandb:PROJECT; repeatable", sep=" ")
    run_name: str = field("", "with --track: the run's name there (the MLflow and W&B run's, the start of the "
                              "TensorBoard folder's); empty = the run id")
    run_settings: str = field("", "with --track: a JSON file of the settings that shaped the run, recorded beside "
                                  "the aggregator's own: its \"config\" object as run/NAME, its \"clients\" object "
                                  "({client id: settings}) as client/ID/NAME (fedse run passes its run.json)")
    max_adapter_mb: float = field(512.0, "largest adapter accepted, in MB")
    seed: int = field(0, "seed of the round-0 LoRA initialisation and of the privacy noise")
    torch_threads: int = field(1, "torch CPU threads for aggregation (0 = torch's default)")
    log_level: str = field("INFO", "log level")
    health_address: str = field("", "extra plain-gRPC address serving only the health service, for Kubernetes "
                                    "probes when TLS is on (empty = none)")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.rounds < 1:
            raise ConfigError(f"--rounds must be at least 1, got {self.rounds}")
        if self.min_clients < 1:
            raise ConfigError(f"--min-clients must be at least 1, got {self.min_clients}")
        if self.start_clients < 0:
            raise ConfigError(f"--start-clients must be 0 (= --min-clients) or more, got {self.start_clients}")
        if self.round_deadline_s <= 0:
            raise ConfigError(f"--round-deadline-s must be positive, got {self.round_deadline_s}")
        if self.strategy not in STRATEGIES:
            raise ConfigError(f"--strategy {self.strategy!r} is unknown: use one of {', '.join(STRATEGIES)}")
        for name in ("wait_after_min_s", "heartbeat_timeout_s", "heartbeat_interval_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"--{name.replace('_', '-')} must be positive, got {getattr(self, name)}")
        try:
            validate_params(self.strategy, self.strategy_params())
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        if self.max_adapter_mb <= 0:
            raise ConfigError(f"--max-adapter-mb must be positive, got {self.max_adapter_mb}")
        if self.secure_aggregation:
            self._check_secure()
        if not 0 < self.dp_delta < 1:
            raise ConfigError(f"--dp-delta must lie strictly between 0 and 1 (e.g. 1e-5), got {self.dp_delta}")
        try:
            self.selection().policy()
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        self._check_ranks()
        try:  # what the round schedule --mode names cannot do with the other settings
            schedule_for(self.mode).check_settings(self)
        except ValueError as exc:
            raise ConfigError(f"--mode: {exc}" if self.mode not in SCHEDULES else str(exc)) from None
        try:
            check_installed([Target.parse(spec) for spec in self.track])
            if self.run_settings:
                read_run_settings(self.run_settings)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        if self.secure_aggregation and self.clients_per_round == 1:
            raise ConfigError("--clients-per-round 1 cannot work with --secure-aggregation: the mean of one upload "
                              "is that client's adapter; give 2 or more")

    def _check_ranks(self) -> None:
        """Mixed ranks need a strategy that combines factors of different shapes."""
        if self.max_lora_rank < 0:
            raise ConfigError(f"--max-lora-rank must be 0 (one rank) or more, got {self.max_lora_rank}")
        mixed = [name for name, s in BY_NAME.items() if s.mixed]
        if self.max_lora_rank and not BY_NAME[self.strategy].mixed:
            raise ConfigError(f"--max-lora-rank {self.max_lora_rank} lets clients train different ranks, whose factors "
                              f"--strategy {self.strategy} cannot average element by element: use "
                              f"{', '.join(mixed)}, or leave --max-lora-rank at 0")
        if BY_NAME[self.strategy].mixed and not self.max_lora_rank:
            raise ConfigError(f"--strategy {self.strategy} combines clients of mixed LoRA ranks: give the run's "
                              "maximum rank with --max-lora-rank (e.g. 16), at which the run's adapter is held")
        for name in ("async_concurrency", "async_buffer", "async_max_staleness"):
            if getattr(self, name) < 0:
                raise ConfigError(f"--{name.replace('_', '-')} must be 0 or more, got {getattr(self, name)}")
        if self.async_concurrency and self.async_buffer > self.async_concurrency:
            raise ConfigError(f"--async-buffer {self.async_buffer} is more than --async-concurrency "
                              f"{self.async_concurrency}: a buffer that more clients must fill than may train at once "
                              "waits for stragglers; give a buffer of at most the concurrency")
        size = self.async_buffer or self.async_concurrency
        if size and size < self.min_clients:
            raise ConfigError(f"--min-clients {self.min_clients} is more than a buffer holds ({size}, --async-buffer "
                              "or else --async-concurrency): a fold needs min-clients updates; give a buffer of at "
                              "least --min-clients, or lower it")
        if not (math.isfinite(self.async_server_lr) and self.async_server_lr > 0):
            raise ConfigError(f"--async-server-lr must be a positive number, got {self.async_server_lr} (1 = the "
                              "buffer's mean update itself)")

    def _check_secure(self) -> None:
        """Secure aggregation's preconditions: what a masked sum can give, and enough clients to hide one."""
        if self.strategy not in SECURE_STRATEGIES:
            raise ConfigError(
                f"--strategy {self.strategy} cannot work with --secure-aggregation: the aggregator sees only the "
                f"sum of the masked adapters, and {self.strategy} needs each client's values (a median, a trimmed "
                "mean or the products B_k A_k are not functions of a sum); use --strategy fedavg or weighted "
                "(zero-pad with mixed ranks), or turn secure aggregation off")
        if self.noise_multiplier > 0 and not BY_NAME[self.strategy].noise_calibrated:
            raise ConfigError("--noise-multiplier with --secure-aggregation calibrates the clients' noise for the "
                              "unweighted mean: use --strategy fedavg, or set --noise-multiplier 0")
        if self.secure_threshold != 0 and self.secure_threshold < 2:
            raise ConfigError(f"--secure-threshold must be 0 (a majority) or at least 2, got {self.secure_threshold}")
        if self.secure_neighbours != 0 and self.secure_neighbours < 2:
            raise ConfigError(f"--secure-neighbours must be 0 (everyone) or at least 2, got {self.secure_neighbours}")
        if self.secure_threshold > max(self.secure_neighbours + 1, 2) and self.secure_neighbours:
            raise ConfigError(f"--secure-threshold {self.secure_threshold} is more than a neighbourhood holds "
                              f"({self.secure_neighbours} neighbours and the client itself)")
        if self.secure_stage_timeout_s <= 0:
            raise ConfigError(f"--secure-stage-timeout-s must be positive, got {self.secure_stage_timeout_s}")
        if not 2 <= self.secure_max_roster <= MAX_CLIENTS:
            raise ConfigError(f"--secure-max-roster must be 2 to {MAX_CLIENTS} (what a fixed-point sum "
                              f"holds), got {self.secure_max_roster}")
        if not 0 <= self.secure_dropout_rate < 1:
            raise ConfigError(f"--secure-dropout-rate must be in [0, 1), got {self.secure_dropout_rate}")
        least = secagg.min_neighbours(self.secure_max_roster, self.secure_dropout_rate)
        if 0 < self.secure_neighbours < least:
            raise ConfigError(
                f"--secure-neighbours {self.secure_neighbours} is too few for a roster of up to "
                f"{self.secure_max_roster} clients at a dropout rate of {self.secure_dropout_rate:g}: such a ring "
                f"splits too often (Bell et al. 2020); give at least {least}, or 0 (everyone), or a smaller "
                "--secure-max-roster")

    def settings(self) -> RunSettings:
        return RunSettings(
            run_id=self.run_id, num_rounds=self.rounds, min_clients=self.min_clients,
            start_clients=self.start_clients,
            round_deadline_s=self.round_deadline_s, strategy=self.strategy,
            max_adapter_bytes=int(self.max_adapter_mb * 1024 * 1024), seed=self.seed,
            wait_after_min_s=self.wait_after_min_s, heartbeat_timeout_s=self.heartbeat_timeout_s,
            heartbeat_interval_s=self.heartbeat_interval_s, params=self.strategy_params(),
            secure=self.secure_aggregation, secure_threshold=self.secure_threshold,
            secure_neighbours=self.secure_neighbours,
            secure_stage_timeout_s=self.secure_stage_timeout_s,
            secure_ca=self.tls_ca if self.secure_aggregation else "",
            secure_max_roster=self.secure_max_roster, dp_delta=self.dp_delta, selection=self.selection(),
            mode=self.mode, async_concurrency=self.async_concurrency, async_buffer=self.async_buffer,
            async_max_staleness=self.async_max_staleness, async_server_lr=self.async_server_lr,
            max_lora_rank=self.max_lora_rank,
        )

    def selection(self) -> SelectionSettings:
        return SelectionSettings(self.selector, self.clients_per_round, self.selection_fraction, self.fairness_rounds,
                                 self.selector_model)

    def strategy_params(self) -> StrategyParams:
        return StrategyParams(trim_fraction=self.trim_fraction, clip_norm=self.clip_norm,
                              noise_multiplier=self.noise_multiplier, seed=self.seed)


def load_selector_model(federation: RoundKeeper) -> None:
    """Loads agent-llm's model at start (--selector-model, else the base model of a run resumed), not at
    the first selection: a model that cannot load stops the aggregator here, with one line saying so. A
    new run without --selector-model learns its base model at the first join; it loads then, within the
    first selection's deadline."""
    agent = model_agent(federation.policy)
    name = (agent.model or federation.run.base_model or "") if agent is not None else ""
    if agent is None or not name:
        return
    try:
        agent.load(name)
    except Exception as exc:  # noqa: BLE001 - any failure to load is the operator's to fix
        raise ConfigError(f"--selector agent-llm cannot load its model {name!r}: {' '.join(str(exc).split())[:300]}"
                          ) from None


class Aggregator:
    """The running aggregator: the gRPC service plus the ticker that enforces round deadlines."""

    def __init__(self, config: AggregatorConfig, servicer: type[FederationServicer] = FederationServicer):
        self.config = config
        if config.torch_threads:
            import torch

            torch.set_num_threads(config.torch_threads)
        store = Store(pathlib.Path(config.state_dir), config.run_id, masked=config.secure_aggregation)
        self.tracker = Tracker([Target.parse(t) for t in config.track], store.root, config.run_id, config.rounds,
                               {f.name: getattr(config, f.name) for f in dataclasses.fields(config)},
                               store.metrics_reports()) if config.track else None
        try:
            self.federation = RoundKeeper(config.settings(), store, tracker=self.tracker)
            load_selector_model(self.federation)
        except Exception:
            self._close_tracker()
            raise
        self.service = Service("aggregator", config.address, max_workers=WORKERS, credentials=server_credentials(config),
                               interceptors=server_interceptors(config), health_address=config.health_address)
        self.servicer = servicer(self.federation, identity=peer_identity)
        fpb_grpc.add_FederationServiceServicer_to_server(self.servicer, self.service.server)
        self.port = self.service.port
        self._stop = threading.Event()
        self._ticker = threading.Thread(target=self._tick, name="round-ticker", daemon=True)

    def _tick(self) -> None:
        while not self._stop.wait(0.5):
            self.federation.tick()

    def start(self) -> "Aggregator":
        self.service.start()
        self._ticker.start()
        self.service.ready(["fedse.v1.FederationService"])
        return self

    def wait(self) -> None:
        """Serves until the service stops (SIGTERM or SIGINT after service.stop_on_signals(), or stop())."""
        self.service.wait_for_termination()
        self._stop.set()
        self._close_tracker()

    def stop(self, grace: float = 2.0) -> None:
        self._stop.set()
        self.service.stop(grace)
        self._close_tracker()

    def _close_tracker(self) -> None:
        if self.tracker is not None:
            self.tracker.close()
            self.tracker = None


def create_server(config: AggregatorConfig,
                  servicer: type[FederationServicer] = FederationServicer) -> tuple[Aggregator, int]:
    agg = Aggregator(config, servicer)
    return agg, agg.port


def serve(config: AggregatorConfig) -> int:
    """Runs the aggregator until SIGTERM or SIGINT."""
    setup_logging("aggregator", config.log_level)
    log = logging.getLogger("aggregator")
    metrics_port = start_metrics(config.metrics_port)
    try:
        agg, port = create_server(config)
    except (ConfigError, ValueError) as exc:  # a --tls-key that is not --tls-cert's; a state dir of other settings
        print(f"configuration error: {exc}", file=sys.stderr)
        return 2
    if config.secure_aggregation and not (config.tls_ca and config.allowed_clients):
        log.warning("secure aggregation without mTLS and --allowed-clients: anyone who reaches this port can "
                    "take part under any client id, and a threshold of its own ids could unmask one client's "
                    "adapter; set --tls-ca, --tls-cert, --tls-key and --allowed-clients")
    agg.service.stop_on_signals()
    agg.start()
    # How it is reached and who it admits: tls off, TLS or mTLS; admits anyone, any certificate of --tls-ca,
    # the --allowed-clients list, or holders of the --token-file token.
    sec = Security.from_config(config)
    tls = {"mtls": "mTLS", "tls": "TLS"}.get(sec.mode.split("+")[0], "off")
    admits = (f"allowed-clients ({len(sec.allowed() or ())} ids)" if config.allowed_clients
              else "any certificate of --tls-ca" if tls == "mTLS" else "anyone")
    if config.token_file:
        admits = "token holders" if admits == "anyone" else f"{admits} holding the token"
    log.info("serving", extra=log_fields(port=port, metrics_port=metrics_port, run_id=config.run_id,
                                         num_rounds=config.rounds, min_clients=config.min_clients,
                                         strategy=config.strategy, tls=tls, admits=admits, selector=config.selector,
                                         mode=config.mode, secure_aggregation=config.secure_aggregation))
    agg.wait()
    return 0


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    return serve(parse_or_exit(AggregatorConfig, argv, prog=prog, shown=shown_for(AggregatorConfig, "server")))
