"""What `fedse run` starts: its settings (RunConfig), the federations of its topology (plan) and the
action scoring of each client (scoring_for).

--topology says who federates with whom, which is all that tells the paper's methods apart beside
the client settings (--explore-tasks, --keep, --history, --lora-r): "federated" (one client per
environment, one aggregator: Fed-SE, FedIT; or several members per environment, --clients or NAME:N
in --envs, each with a share of its training tasks, --task-split), "local" (each client alone with
its own aggregator, nothing averaged across clients: Local) or "centralized" (one client holding
every environment: Centralized).
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Any, Sequence, TypeVar

from fedse.config import ConfigError, Count, field, flags, parse, plain
from fedse.config import scoring_rules as rules_of
from fedse.model.pretrained import TINY_MODEL_NAME, check_base_model, names_tiny_model
from fedse.security.admission import Security
from fedse.splits import member_id, split_members
from services.aggregator.server import AggregatorConfig
from services.client_agent.config import ClientConfig
from services.env_server.server import EnvServerConfig

T = TypeVar("T")

TOPOLOGIES = ("federated", "local", "centralized")
LOOPBACK = "127.0.0.1:0"  # every service listens on a free loopback port, which it logs
# Liveness at the aggregator: clients beat every HEARTBEAT_INTERVAL_S; one silent for
# HEARTBEAT_TIMEOUT_S (several missed beats, so a busy but live client is not taken for dead) is
# not waited for, which is how long a round can wait for a client that died.
HEARTBEAT_INTERVAL_S = 2.0
HEARTBEAT_TIMEOUT_S = 15.0
# fedse run's own defaults, where they differ from the services' (ClientConfig, AggregatorConfig),
# so that a run on one machine shows learning within minutes: each client explores 16 tasks a round
# (not 32) and evaluates 20 test tasks (not all of them), and a round closes after half an hour at
# the latest (not an hour).
LOCAL_DEFAULTS: dict[str, Any] = {"explore_tasks": 16, "eval_tasks": 20, "round_deadline_s": 1800.0}


def setting(service: type, name: str, help: str = "") -> Any:  # noqa: A002 - as fedse.config.field's
    """A RunConfig field passed on to every process of `service` (a config class) as its setting
    `name`: the service's default (LOCAL_DEFAULTS' where it names the setting) and the service's help
    unless `help` says more."""
    own = {f.name: f for f in dataclasses.fields(service)}[name]
    return dataclasses.field(default=LOCAL_DEFAULTS.get(name, own.default),
                             metadata={"help": help or own.metadata["help"], "service": service, "as": name,
                                       **{k: v for k, v in own.metadata.items() if k == "sep"}})


def env_specs(envs: str) -> dict[str, str]:
    """--envs (of fedse run or fedse experiment) as {environment name: its spec as the env server takes
    it}, less the :N of its members (split_members); ConfigError for a malformed spec."""
    from services.env_server import registry

    parts = [split_members(part)[0] for part in envs.split(",") if part.strip()]
    try:
        return {spec.name: spec.text for spec in registry.parse_specs(",".join(parts))}
    except registry.RegistryError as exc:
        raise ConfigError(f"--envs: {exc}") from None


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """Run a whole Fed-SE federation locally (the embedded tiny model unless --base-model is a path)."""

    envs: str = field("maze,wordle,babyai,textcraft,webshop", "environment specs, comma-separated (one client each; "
                                                              "one for all of them with --topology centralized): a "
                                                              "built-in or installed plugin by name, "
                                                              "NAME=package.module:factory or "
                                                              "NAME=agentgym:PROFILE@URL, each with ?KEY=VALUE&... "
                                                              "options (e.g. wordle?vocab_size=30), each may end "
                                                              "in :N, N members sharing its training tasks "
                                                              "(e.g. babyai:40,wordle?vocab_size=30:4; see "
                                                              "--clients)")
    clients: int = field(0, "with --topology federated: this many clients in all, spread over the environments as "
                            "evenly as possible (the first ones take the remainder), the members of each sharing "
                            "its training tasks (--task-split) and evaluating the same test tasks (0 = one client "
                            "per environment, or the :N of --envs)")
    task_split: str = setting(ClientConfig, "task_split")
    members_per_host: int = field(0, "run the members of each environment (--clients, NAME:N) in client hosts "
                                     "(fedse client-host: one process over one model) of at most this many "
                                     "(0 = a process per member)")
    demos: str = field("", "demonstration files (AgentGym's AgentTraj JSON or JSONL) as ENV=PATH pairs, "
                           "comma-separated: the client holding ENV seeds its buffer from PATH (--demos)")
    rounds: int = setting(AggregatorConfig, "rounds")
    results: str = field("results", "folder for results.json, success.png, logs and state; a folder holding an "
                                    "interrupted run with the same settings resumes it")
    replace: bool = field(False, "if --results holds an earlier run, move its files aside to "
                                 "RESULTS.replaced-<time> and start again (without it, a finished run or one "
                                 "with other settings is refused)")
    base_model: str = setting(ClientConfig, "base_model")
    strategy: str = setting(AggregatorConfig, "strategy")
    secure_aggregation: bool = setting(AggregatorConfig, "secure_aggregation")
    track: tuple[str, ...] = setting(AggregatorConfig, "track")
    run_name: str = field("", "with --track: what the trackers call the run, followed by -seed<k> (empty = its "
                              "method, from --topology, --explore-tasks, --strategy, --keep, --history and the LoRA "
                              "rank, e.g. fedse-r8)")
    clip_norm: float = setting(AggregatorConfig, "clip_norm")
    noise_multiplier: float = setting(AggregatorConfig, "noise_multiplier")
    selector: str = setting(AggregatorConfig, "selector")
    clients_per_round: int = setting(AggregatorConfig, "clients_per_round")
    selection_fraction: float = setting(AggregatorConfig, "selection_fraction")
    fairness_rounds: int = setting(AggregatorConfig, "fairness_rounds")
    selector_model: str = setting(AggregatorConfig, "selector_model")
    mode: str = setting(AggregatorConfig, "mode")
    async_concurrency: int = setting(AggregatorConfig, "async_concurrency")
    async_buffer: int = setting(AggregatorConfig, "async_buffer")
    async_max_staleness: int = setting(AggregatorConfig, "async_max_staleness")
    expert_demos: int = setting(ClientConfig, "expert_demos")
    explore_tasks: int = setting(ClientConfig, "explore_tasks")
    topology: str = field("federated", "'federated' (one client per environment, or its members: --clients; one "
                                       "aggregator), 'local' (each client alone with its own aggregator) or "
                                       "'centralized' (one client holding every environment)")
    keep: str = setting(ClientConfig, "keep")
    history: str = setting(ClientConfig, "history")
    explore_tries: int = setting(ClientConfig, "explore_tries")
    temperature: float = setting(ClientConfig, "temperature")
    round_lr: str = setting(ClientConfig, "round_lr")
    expert_share: float = setting(ClientConfig, "expert_share")
    round_trajectories: int = setting(ClientConfig, "round_trajectories")
    lora_r: int = setting(ClientConfig, "lora_r")
    lora_alpha: int = setting(ClientConfig, "lora_alpha")
    guardian: bool = setting(ClientConfig, "guardian")
    memory_limit_mb: int = setting(ClientConfig, "memory_limit_mb")
    privacy_epsilon: float = setting(ClientConfig, "privacy_epsilon")
    lora_ranks: str = field("", "mixed LoRA ranks: ENV=RANK pairs, comma-separated: the client holding ENV trains that "
                                "rank (the others --lora-r), or plain ranks given to the environments in turn (e.g. "
                                "4,16,8); alpha keeps --lora-alpha/--lora-r's ratio; needs --strategy hlora, flexlora "
                                "or zero-pad")
    max_lora_rank: int = field(0, "with --strategy hlora, flexlora or zero-pad: the rank the run's adapter is held at "
                                  "(0 = the largest rank a client trains)")
    eval_tasks: Count = setting(ClientConfig, "eval_tasks")
    lr: float = setting(ClientConfig, "lr")
    policy: str = setting(ClientConfig, "policy")
    precision: str = setting(ClientConfig, "precision")
    epochs: int = setting(ClientConfig, "epochs")
    scoring: str = field("auto", "what clients rank admissible actions by: 'sum' (log-likelihood) or 'calibrated' "
                                 "(less the log-likelihood after an empty prompt), for all, or per environment as "
                                 "env=rule pairs (the others: sum); 'auto' = babyai=calibrated with the embedded "
                                 "tiny model, sum with a real one")
    seed: int = field(0, "seed of everything")
    round_deadline_s: float = setting(AggregatorConfig, "round_deadline_s", "round deadline at the aggregator: a "
                                      "round closes then without the clients that have not uploaded")

    def __post_init__(self) -> None:
        if not self.env_list():
            raise ConfigError("--envs is empty: name at least one environment, e.g. maze,wordle")
        if self.rounds < 1:
            raise ConfigError(f"--rounds must be at least 1, got {self.rounds}")
        if self.topology not in TOPOLOGIES:
            raise ConfigError(f"--topology must be one of {', '.join(TOPOLOGIES)}, got {self.topology!r}")
        self.check_members()
        if self.secure_aggregation and (self.topology != "federated" or sum(self.members().values()) < 2):
            raise ConfigError("--secure-aggregation needs --topology federated and two clients or more: "
                              "a secure round averages two clients' adapters or more")
        ranks = self.rank_pairs()
        if ranks and not self.mixed_ranks():
            raise ConfigError(f"--lora-ranks gives clients different ranks, which --strategy {self.strategy} cannot "
                              "average: use --strategy hlora, flexlora or zero-pad")
        if self.max_lora_rank and self.max_lora_rank < max([self.lora_r, *ranks.values()]):
            raise ConfigError(f"--max-lora-rank {self.max_lora_rank} is below a rank a client trains "
                              f"({max([self.lora_r, *ranks.values()])}): raise it, or give 0 (the largest)")
        ClientConfig(**self.passed_on(ClientConfig))  # the settings passed on, checked by their owners
        AggregatorConfig(**self.passed_on(AggregatorConfig), max_lora_rank=self.run_max_rank())
        specs = self.env_specs()
        from services.env_server import registry

        try:  # here, once (each factory imports and takes its options), not in each server after others started
            for text in specs.values():
                registry.check(registry.parse_spec(text), self.seed)
        except registry.RegistryError as exc:
            raise ConfigError(f"--envs: {exc}") from None

        unknown = set(scoring_rules(self.scoring)) - {"", *specs, *registry.known_names()}
        if unknown:
            raise ConfigError(f"--scoring names {', '.join(sorted(unknown))}: environments are "
                              f"{', '.join(specs)}")
        demos = self.demo_files()
        if set(demos) - set(specs):
            raise ConfigError(f"--demos names {', '.join(sorted(set(demos) - set(specs)))}: this run's environments "
                              f"are {', '.join(specs)}")
        from services.client_agent.training.demos import load_demos

        for env, paths in demos.items():  # every record checked before any process starts
            load_demos(paths, [env])
        check_base_model(self.base_model)  # here, not in each client process after the others have started

    def method(self) -> str:
        """What the run is, for its name in the trackers: fedse (federated, exploring), fedit (federated,
        expert data alone), local or centralized (-explore where they explore), then what differs from
        Fed-SE's defaults, and the LoRA rank: fedse-r8, fedse-keep-all-r8, local-r4, fedse-hlora-ranks4,16,8."""
        base = ("fedse" if self.explore_tasks else "fedit") if self.topology == "federated" else \
            self.topology + ("-explore" if self.explore_tasks else "")
        changed = {f.name: str(getattr(self, f.name)) for f in dataclasses.fields(self)
                   if getattr(self, f.name) != f.default}
        parts = [base] + [changed[k] for k in ("strategy", "selector", "mode") if k in changed]
        parts += [f"{k}-{changed[k]}" for k in ("keep", "history") if k in changed]
        parts += ["secagg"] * self.secure_aggregation + ["dp"] * bool(self.noise_multiplier)
        return "-".join(parts + [f"ranks{self.lora_ranks.replace(' ', '')}" if self.lora_ranks else f"r{self.lora_r}"])

    def passed_on(self, service: type) -> dict[str, Any]:
        """This run's settings that every process of `service` takes, by their names there."""
        return {f.metadata["as"]: getattr(self, f.name) for f in dataclasses.fields(self)
                if f.metadata.get("service") is service}

    def mixed_ranks(self) -> bool:
        """Whether the strategy combines clients of mixed LoRA ranks (hlora, flexlora, zero-pad)."""
        from services.aggregator.strategies import BY_NAME

        return self.strategy in BY_NAME and BY_NAME[self.strategy].mixed

    def rank_pairs(self) -> dict[str, int]:
        """--lora-ranks as {environment: rank}: ENV=RANK pairs, or plain ranks given to the environments in
        order (cycled: "4,16,8"); ConfigError for a malformed one."""
        parts = [p.strip() for p in self.lora_ranks.split(",") if p.strip()]
        plain = parts and all("=" not in p for p in parts)
        envs = list(self.env_specs())
        pairs = [(env, parts[i % len(parts)]) for i, env in enumerate(envs)] if plain else \
            [tuple(x.strip() for x in p.partition("=")[::2]) for p in parts]
        out: dict[str, int] = {}
        for env, rank in pairs:
            if not env or not rank.isdigit() or int(rank) < 1:
                raise ConfigError(f"--lora-ranks {self.lora_ranks!r}: write ENV=RANK pairs separated by commas (e.g. "
                                  "maze=4,wordle=16), or ranks given to the environments in turn (e.g. 4,16,8), each "
                                  "a positive integer")
            out[env] = int(rank)
        unknown = set(out) - set(envs)
        if unknown:
            raise ConfigError(f"--lora-ranks names {', '.join(sorted(unknown))}: this run's environments are "
                              f"{', '.join(envs)}")
        return out

    def client_lora(self, envs: Sequence[str]) -> tuple[int, int]:
        """(lora_r, lora_alpha) of the client holding `envs`: the largest rank --lora-ranks gives them (else
        --lora-r), with alpha at --lora-alpha/--lora-r's ratio."""
        given = self.rank_pairs()
        r = max((given[e] for e in envs if e in given), default=self.lora_r)
        if not r:  # --lora-r 0: the guardian chooses (guardian.alpha_for)
            return r, self.lora_alpha
        from services.client_agent.training.guardian import REFERENCE_RANK

        return r, max(1, round(r * self.lora_alpha / (self.lora_r or REFERENCE_RANK)))

    def run_max_rank(self) -> int:
        """The aggregator's --max-lora-rank: 0 for a strategy of one rank, else --max-lora-rank or the largest
        rank a client trains."""
        if not self.mixed_ranks():
            return 0
        from services.client_agent.training.guardian import DEFAULT_TOP_RANK

        return self.max_lora_rank or max([self.lora_r, *self.rank_pairs().values()]) or DEFAULT_TOP_RANK

    def env_specs(self) -> dict[str, str]:
        """Each environment's name and its spec as the env server takes it, less the :N of its members
        (parsed only: __post_init__ checked that each can be served); ConfigError for a malformed spec."""
        return env_specs(self.envs)

    def env_parts(self) -> list[tuple[str, int]]:
        """--envs as (spec, members given: N where it ends in :N, else 0), in order (split_members)."""
        return [split_members(part) for part in self.envs.split(",") if part.strip()]

    def members(self) -> dict[str, int]:
        """Each environment's number of members (clients sharing its training tasks): its :N in --envs,
        else --clients spread as evenly as possible (the first environments take the remainder), else 1."""
        envs = list(self.env_specs())
        given = [n for _, n in self.env_parts()]
        if self.clients:
            base, extra = divmod(self.clients, len(envs))
            return {env: base + (i < extra) for i, env in enumerate(envs)}
        return {env: n or 1 for env, n in zip(envs, given)}

    def check_members(self) -> None:
        """--clients and the :N of --envs: ConfigError where they cannot be planned."""
        given = [n for _, n in self.env_parts() if n]  # split_members refuses a :0
        if self.clients < 0:
            raise ConfigError(f"--clients must be 0 (one client per environment) or more, got {self.clients}")
        if (self.clients or given) and self.topology != "federated":
            raise ConfigError(f"--clients and the :N of --envs give environments several members, which needs "
                              f"--topology federated, not {self.topology}")
        if self.members_per_host < 0 or (self.members_per_host and not (self.clients or given)):
            raise ConfigError("--members-per-host needs members (--clients, or NAME:N in --envs) and must be at "
                              f"least 1 (or 0: a process per member), got {self.members_per_host}")
        if self.clients and given:
            raise ConfigError("give environments their members either as NAME:N in --envs or with --clients, not "
                              "both")
        if self.clients and self.clients < len(self.env_list()):
            raise ConfigError(f"--clients {self.clients} is fewer than the {len(self.env_list())} environments: "
                              "each environment needs a client at least")

    def env_list(self) -> list[str]:
        return list(self.env_specs()) if self.envs.strip() else []

    def demo_files(self) -> dict[str, list[str]]:
        """ENV -> its demonstration files, in the order given."""
        out: dict[str, list[str]] = {}
        for part in (p.strip() for p in self.demos.split(",") if p.strip()):
            env, sep, path = part.partition("=")
            if not sep or not env.strip() or not path.strip():
                raise ConfigError(f"--demos {part!r}: write ENV=PATH pairs separated by commas, e.g. "
                                  "maze=demos/maze.json")
            out.setdefault(env.strip(), []).append(path.strip())
        return out


@dataclasses.dataclass(frozen=True)
class Client:
    """A client agent to start: its id, the environments it holds (its env server hosts them) and,
    for one of several members of an environment, its share of the training tasks ("K/N")."""

    client_id: str
    envs: tuple[str, ...]
    share: str = ""

    @property
    def label(self) -> str:
        """Names its processes and logs: env_server-maze, client_agent-maze+wordle; a member's
        client_agent-babyai-03 (its id less org-)."""
        return self.client_id.removeprefix("org-") if self.share else "+".join(self.envs)


@dataclasses.dataclass(frozen=True)
class Federation:
    """One aggregator (process and state folder `name`, run `run_id`) and the clients that join it."""

    name: str
    run_id: str
    clients: tuple[Client, ...]


def plan(cfg: RunConfig) -> list[Federation]:
    """The aggregators and clients of cfg.topology."""
    envs = cfg.env_list()
    if cfg.topology == "local":
        return [Federation(f"aggregator-{e}", f"local-{e}", (Client(f"org-{e}", (e,)),)) for e in envs]
    if cfg.topology == "centralized":
        return [Federation("aggregator", "local", (Client("org-central", tuple(envs)),))]
    return [Federation("aggregator", "local", tuple(c for e, n in cfg.members().items() for c in env_members(e, n)))]


def env_members(env: str, n: int) -> list[Client]:
    """The `n` clients sharing environment `env`'s training tasks: org-ENV alone with all of them, else
    org-ENV-00 .. org-ENV-<n-1> (zero-padded), member K with share "K/n"."""
    if n == 1:
        return [Client(f"org-{env}", (env,))]
    return [Client(member_id(f"org-{env}", k, n), (env,), f"{k}/{n}") for k in range(n)]


TINY_SCORING = "babyai=calibrated"  # what --scoring auto means for the embedded tiny model (docs/results.md)


def scoring_rules(spec: str, base_model: str = TINY_MODEL_NAME) -> dict[str, str]:
    """--scoring as {environment: rule} (fedse.config.scoring_rules), "auto" as the model's rules."""
    if spec.strip() == "auto":
        spec = TINY_SCORING if names_tiny_model(base_model) else "sum"
    return rules_of(spec)


def scoring_for(spec: str, envs: Sequence[str], base_model: str = TINY_MODEL_NAME) -> str:
    """The --scoring of a client holding `envs`: their rule where they all have the same, else each
    environment's (ENV=RULE pairs: a Centralized client scores BabyAI as BabyAI's own client does)."""
    rules = scoring_rules(spec, base_model)
    chosen = {e: rules.get(e, rules[""]) for e in envs}
    if len(set(chosen.values())) == 1:
        return chosen[envs[0]]
    return ",".join(f"{e}={rule}" for e, rule in chosen.items())


def service_config(service: type[T], **settings: Any) -> T:
    """The config that a process of `service` given `settings` as flags builds: those settings, the
    FEDSE_* variables it inherits from this process for the others, else the defaults. Started with
    to_argv() of it, the process has exactly this config."""
    return parse(service, flags(settings))


def env_server_config(cfg: RunConfig, client: Client) -> EnvServerConfig:
    """The env server of `client`, hosting its environments."""
    specs = cfg.env_specs()
    return service_config(EnvServerConfig, address=LOOPBACK, envs=",".join(specs[e] for e in client.envs),
                          metrics_port=-1, seed=cfg.seed)


def tracked(cfg: RunConfig, fed: Federation) -> dict[str, str]:
    """With --track, what names `fed`'s run there and what it records: --run-name (else the run's
    method) and the seed, and the clients' environments where each has its own federation
    (fedse-r8-seed0, local-r8-seed0-maze); run.json (the run's settings and its clients', which
    launcher.claim writes at start)."""
    if not cfg.track:
        return {}
    name = f"{cfg.run_name or cfg.method()}-seed{cfg.seed}"
    if cfg.topology == "local":
        name += "-" + "+".join(c.label for c in fed.clients)
    return {"run_name": name, "run_settings": str(pathlib.Path(cfg.results) / "run.json")}


def aggregator_config(cfg: RunConfig, fed: Federation, state: pathlib.Path) -> AggregatorConfig:
    """The aggregator of `fed`, keeping its run under state/<fed.name>. Round 0 waits for every client
    to join; a round closes once every client still heard from has uploaded, so without one that
    died; the deadline alone cuts a healthy round short."""
    return service_config(AggregatorConfig, address=LOOPBACK, metrics_port=-1, state_dir=str(state / fed.name),
                          run_id=fed.run_id, **cfg.passed_on(AggregatorConfig), max_lora_rank=cfg.run_max_rank(),
                          start_clients=len(fed.clients),
                          min_clients=1, heartbeat_interval_s=HEARTBEAT_INTERVAL_S,
                          heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S, wait_after_min_s=cfg.round_deadline_s,
                          seed=cfg.seed, **tracked(cfg, fed))


def client_config(cfg: RunConfig, client: Client, env_server: str, aggregator: str, state: pathlib.Path,
                  threads: int) -> ClientConfig:
    """The client agent `client`, talking to the env server and aggregator at those addresses, with
    `threads` torch threads and its state under state/clients."""
    demos = cfg.demo_files()
    lora_r, lora_alpha = cfg.client_lora(client.envs)
    # Every member of a local federation is the one researcher's: none needs to withstand the others.
    settings = {**cfg.passed_on(ClientConfig), "lora_r": lora_r, "lora_alpha": lora_alpha,
                "secure_tolerate_colluders": 0}
    return service_config(ClientConfig, client_id=client.client_id, env=",".join(client.envs), env_server=env_server,
                          task_share=client.share, aggregator=aggregator, address=LOOPBACK, metrics_port=-1, state_dir=str(state / "clients"),
                          **settings, scoring=scoring_for(cfg.scoring, client.envs, cfg.base_model),
                          seed=cfg.seed, torch_threads=threads,
                          demos=tuple(path for e in client.envs for path in demos.get(e, [])))


# A client's settings that say where it runs, not what it does: left out of the settings recorded.
PLACE_SETTINGS = ("client_id", "env_server", "aggregator", "address", "metrics_port", "state_dir", "torch_threads",
                  *(f.name for f in dataclasses.fields(Security)))


def client_settings(cfg: RunConfig) -> dict[str, dict[str, Any]]:
    """Each client's settings as fedse run starts it ({client id: settings}, as JSON holds them), less
    where it runs (PLACE_SETTINGS): what run.json records beside the run's, and the trackers with it."""
    out = {}
    for fed in plan(cfg):
        for c in fed.clients:
            config = client_config(cfg, c, LOOPBACK, LOOPBACK, pathlib.Path(cfg.results) / "state", threads=1)
            out[c.client_id] = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)
                                if f.name not in PLACE_SETTINGS}
    return json.loads(json.dumps(plain(out)))
