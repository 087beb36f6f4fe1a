"""Client agent configuration (flags and FEDSE_* environment variables)."""

from __future__ import annotations

import dataclasses

from fedse.config import ALL, ConfigError, Count, field, refuse_zero, scoring_rules
from fedse.security.admission import Security
from fedse.model.pretrained import TINY_MODEL_NAME
from fedse.splits import parse_share, split_for

# What exploration adds to the buffer (buffer.to_keep); what a round trains on is buffer.HISTORIES.
KEEP_MODES = ("successes", "all")


@dataclasses.dataclass(frozen=True)
class ClientConfig(Security):
    """A Fed-SE client agent: explores its environment(s), keeps successes, trains LoRA, federates.

    The TLS / token settings apply to the aggregator and, unless --env-server-plain, to the env server."""

    client_id: str = field("client-0", "unique, stable id of this client in the run")
    env: str = field("maze", "environment name on the env server, or several comma-separated (e.g. 'maze,wordle'): "
                              "one client then holds the data of all of them and trains one adapter on it all "
                              "(the Centralized method)")
    env_server: str = field("127.0.0.1:50051", "env_server gRPC address")
    aggregator: str = field("127.0.0.1:50060", "aggregator gRPC address")
    address: str = field("0.0.0.0:50070", "this agent's gRPC health address (port 0 picks one)")
    metrics_port: int = field(9100, "Prometheus /metrics port (0 picks one, -1 disables)")
    state_dir: str = field("state/client", "directory for this client's buffer and adapters")
    base_model: str = field(TINY_MODEL_NAME, f"'{TINY_MODEL_NAME}' (built in code) or a local Hugging Face model directory "
                                             "(`make model` writes models/smollm2-135m-instruct)")
    device: str = field("", "torch device; empty picks CUDA when present, else CPU")
    lora_r: int = field(8, "LoRA rank (0 = the guardian's choice, with --guardian)")
    lora_alpha: int = field(16, "LoRA alpha (with --lora-r 0: read as rank 8's, the alpha of the rank chosen keeps its "
                                "ratio)")
    lora_dropout: float = field(0.0, "LoRA dropout")
    target_modules: str = field("all-linear", "LoRA target modules: 'all-linear' or comma-separated names")
    lr: float = field(3e-3, "AdamW learning rate (cosine schedule); the paper's 5e-5 suits 7B models")
    epochs: int = field(2, "epochs over the whole buffer per round")
    batch_size: int = field(8, "agent turns per optimizer step, whether a training sequence holds one turn (the plain "
                               "format) or the turns of an episode that share one prompt window (the chat format)")
    train_batch_tokens: int = field(0, "most tokens (rows x padded width) per training micro-batch; gradients "
                                       "accumulate over the micro-batches of a step (0 = 1024 on CPU, 32768 on GPU)")
    max_history: int = field(-1, "earlier turns shown in each prompt (-1 = real models: the whole episode while it "
                                 "fits the prompt window; the tiny model: 1)")
    precision: str = field("auto", "'fp32', 'bf16' (bfloat16 autocast for model passes; LoRA weights, optimizer and "
                                   "scores stay fp32) or 'auto' (for a real model on a CPU with native bfloat16 (AMX / "
                                   "AVX512-BF16) the faster of the two, measured at start; bf16 on CUDA, where real "
                                   "models load in bf16; else fp32)")
    score_cache_mb: int = field(512, "memory for the KV caches of recent prompts that later prompts reuse (real models)")
    expert_demos: int = field(20, "expert demonstrations seeding the buffer (D_0), in each environment that has an "
                                  "expert (an environment without one is seeded from --demos files, or not at all)")
    demos: tuple[str, ...] = field((), "a file of demonstrations seeding the buffer (D_0) besides or instead of the "
                                       "expert's: AgentGym's AgentTraj format, a JSON array (or JSON Lines) of "
                                       "{\"item_id\": \"<env>_<index>\", \"conversations\": [{\"from\": \"human\" or "
                                       "\"gpt\", \"value\": ...}]}; with several --env the item_id's <env> picks the "
                                       "environment, with one every record is its. Repeat the flag for several files; "
                                       "a malformed file stops the client before it joins")
    explore_tasks: int = field(32, "training tasks attempted per round in each environment (0 = no exploration: "
                                   "train on the expert demonstrations only, as FedIT, Local and Centralized do)")
    keep: str = field("successes", "explored trajectories added to the buffer: 'successes' (the paper's success "
                                   "filter) or 'all' (ablation 'no filter': failures too)")
    history: str = field("cumulative", "what round t trains on: 'cumulative' (D_t = D_{t-1} plus round t's kept "
                                       "trajectories, the paper), 'round' (ablation 'no history': the expert "
                                       "demonstrations D_0 plus round t's kept trajectories only) or 'shortest' "
                                       "(D_0 plus each explored task's shortest success so far)")
    explore_tries: int = field(1, "attempts at each exploration task per round, each drawn afresh at --temperature; "
                                  "the first success of a task is kept (more tries find successes on tasks the "
                                  "model rarely solves)")
    round_lr: str = field("constant", "the rate each round trains at: 'constant' (--lr, the paper's), 'cosine' "
                                      "(--lr falling to a tenth by the last round) or 'halving:K' (halved every K rounds)")
    expert_share: float = field(0.0, "the least share of the training trajectories that the seed demonstrations "
                                     "make up, repeated as needed once exploration has grown the buffer (0 = as "
                                     "the buffer holds them, the paper's)")
    round_trajectories: int = field(0, "the most trajectories a round trains on: every seed demonstration and, for the "
                                       "rest, a sample of the explored ones drawn afresh each round, so a round's "
                                       "training steps stop growing with the buffer (0 = all, the paper's)")
    eval_tasks: Count = field(ALL, "held-out test tasks evaluated per round: a number, or 'all'")
    task_share: str = field("", "'K/N': this client is member K (0-based) of N members sharing each of its "
                                "environments' training tasks, each member a disjoint share (--task-split; the "
                                "held-out test tasks are every member's); '' = all tasks")
    task_split: str = field("iid", "with --task-share, how the members share the training tasks, computed from "
                                   "--seed alike in every member: 'iid' (a seeded shuffle dealt round-robin) or "
                                   "'dirichlet:ALPHA' (per task type, the members' proportions drawn from "
                                   "Dirichlet(ALPHA): a small ALPHA, e.g. 0.1, gives each member few types)")
    concurrency: int = field(0, "episodes run at once, whose turns' prompts share the model's passes (0 = 16 for the "
                                "tiny model and on GPUs; 4 for a real model on CPU, where each episode keeps its "
                                "previous turn's KV cache, so that those caches stay in --score-cache-mb)")
    temperature: float = field(1.0, "sampling temperature during exploration")
    policy: str = field("score", "'score': rank admissible actions by log-likelihood; 'generate': parse ReAct text. "
                                 "In an environment that lists no actions the agent always writes its action "
                                 "(ReAct text, the action parsed from it)")
    max_new_tokens: int = field(128, "most tokens the agent writes per turn where it writes its action itself (an "
                                     "environment that lists no actions): its thought and its action")
    scoring: str = field("sum", "with --policy score, what ranks the admissible actions: 'sum' (their "
                                "log-likelihood) or 'calibrated' (less their log-likelihood after an empty prompt "
                                "under the same weights: no preference for short actions); or ENV=RULE pairs, "
                                "comma-separated, for a client of several environments (e.g. "
                                "'sum,babyai=calibrated': the bare rule is the others')")
    seed: int = field(0, "seed for the base model (tiny), LoRA init, task sampling and training")
    torch_threads: int = field(0, "torch CPU threads (0 = the cores this process may run on: its CPU affinity "
                                  "and cgroup quota)")
    round_timeout_s: float = field(7200.0, "longest wait for the next round before giving up")
    env_retry_s: float = field(300.0, "how long calls to an unavailable env server (a restart) are retried, with "
                                      "backoff, before the client gives up; episodes whose sessions a restarted "
                                      "server lost start again")
    transport_dtype: str = field("", "dtype of adapters on the wire, both directions: '' (the run's schema dtype, "
                                     "fp32) or 'bfloat16' (half the bytes; the global adapter stays in the "
                                     "schema's dtype)")
    heartbeat_interval_s: float = field(0.0, "seconds between heartbeats to the aggregator "
                                             "(0 = the interval the aggregator asks for at Join)")
    require_secure_aggregation: bool = field(False, "upload only to a run with secure aggregation: a run that is not "
                                                    "secure is refused at join, and nothing is uploaded to it")
    secure_min_threshold: float = field(0.5, "secure aggregation: the least threshold this client accepts, as a share "
                                             "of its neighbourhood; it takes part only where the threshold is above "
                                             "it (0.5: a majority; 0.66 keeps its adapter hidden from an aggregator "
                                             "that lies with up to a third of the neighbourhood colluding)")
    secure_tolerate_colluders: int = field(1, "secure aggregation: the fewest colluding neighbours an attempt must "
                                              "withstand before this client takes part (with its mTLS files, against "
                                              "an aggregator that lies); 0 accepts the smallest federations, where "
                                              "another member or the aggregator could learn its adapter")
    secure_dropout_rate: float = field(0.05, "secure aggregation: the share of a roster this client expects to drop "
                                             "out of a stage; it refuses a masking graph sparser than the least ring "
                                             "that keeps whole at that rate")
    secure_members: str = field("", "secure aggregation: the federation's member list, a file that `fedse certs "
                                    "members` signed with the CA key (checked against --tls-ca) or one client id a "
                                    "line; every roster member must be on it (empty: no list)")
    guardian: bool = field(False, "before joining, size the work to this machine's memory by measuring one training "
                                  "step: the largest LoRA rank (--lora-r 0), micro-batch (--train-batch-tokens 0) and "
                                  "precision (--precision auto) that fit; a value given pins it")
    guardian_model: str = field("", "--guardian: a language model that chooses among the settings measured to fit, "
                                    "given --guardian-notes ('fedse-tiny', a local Hugging Face model directory, or "
                                    "'base': this client's base model); its answer is checked, and the tools' choice "
                                    "stands where it fails (empty = the tools' choice)")
    guardian_notes: str = field("", "--guardian-model: the organisation's wishes in words, e.g. 'leave half the "
                                    "memory to other work'")
    memory_limit_mb: int = field(0, "the memory this client may hold, in MB (0 = what the GPU has free, or the "
                                    "container's limit or the machine's available memory): --guardian sizes the "
                                    "work to it, acting merges the LoRA into the weights only where the copy fits "
                                    "half of what is left, and training recomputes activations where a "
                                    "micro-batch's would not fit a quarter of it")
    privacy_epsilon: float = field(0.0, "this organisation's privacy budget over every run it takes part in (a "
                                        "ledger that a new run id does not reset): the epsilon of (epsilon, "
                                        "delta)-DP its uploads may spend; once the next round would exceed it the "
                                        "client declines the rest (0 = no budget; needs a run with secure "
                                        "aggregation and noise, which this client adds itself)")
    privacy_delta: float = field(1e-5, "the delta of --privacy-epsilon's budget")
    reset_privacy_ledger: bool = field(False, "the organisation's reset of its privacy budget: moves the ledger of "
                                              "what its uploads spent, over every run (privacy.json in the state "
                                              "directory), aside to a timestamped file, and exits without joining; "
                                              "the next start spends from zero")
    log_level: str = field("INFO", "log level")
    env_server_plain: bool = field(False, "talk to the env server without TLS or token (e.g. one in the same pod "
                                          "or on the same host), whatever the aggregator link uses")

    def __post_init__(self) -> None:
        super().__post_init__()
        positive = {"lora_alpha": self.lora_alpha, "epochs": self.epochs, "batch_size": self.batch_size}
        if self.lora_r < (0 if self.guardian else 1):
            raise ConfigError(f"--lora-r must be at least 1 (or 0 with --guardian: its choice), got {self.lora_r}")
        if self.memory_limit_mb < 0 or self.train_batch_tokens < 0:
            raise ConfigError("--memory-limit-mb and --train-batch-tokens must be 0 (automatic) or more")
        if not (self.privacy_epsilon >= 0 and self.privacy_epsilon < float("inf")):
            raise ConfigError(f"--privacy-epsilon must be a finite number >= 0 (0 = no budget), got {self.privacy_epsilon}")
        if not 0 < self.privacy_delta < 1:
            raise ConfigError(f"--privacy-delta must lie strictly between 0 and 1 (e.g. 1e-5), got {self.privacy_delta}")
        for name, value in positive.items():
            if value < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be at least 1, got {value}")
        if self.max_new_tokens < 1:
            raise ConfigError(f"--max-new-tokens must be at least 1, got {self.max_new_tokens}")
        if any(not path.strip() for path in self.demos):
            raise ConfigError("--demos names an empty path: give a file of AgentTraj demonstrations")
        for name in ("expert_demos", "explore_tasks", "eval_tasks", "torch_threads", "train_batch_tokens",
                     "concurrency", "score_cache_mb"):
            if getattr(self, name) < 0:
                raise ConfigError(f"--{name.replace('_', '-')} must not be negative")
        refuse_zero(self.eval_tasks, "--eval-tasks", "test task evaluated")
        self._check_share()
        if not self.lr > 0:
            raise ConfigError(f"--lr must be positive, got {self.lr}")
        if self.temperature <= 0:
            raise ConfigError(f"--temperature must be positive, got {self.temperature}")
        if self.max_history < -1:
            raise ConfigError(f"--max-history must be -1 (the whole episode) or at least 0, got {self.max_history}")
        if self.precision not in ("auto", "fp32", "bf16"):
            raise ConfigError(f"--precision must be 'auto', 'fp32' or 'bf16', got {self.precision!r}")
        if self.policy not in ("score", "generate"):
            raise ConfigError(f"--policy must be 'score' or 'generate', got {self.policy!r}")
        scoring_rules(self.scoring)  # a rule, or ENV=RULE pairs: ConfigError otherwise
        if self.transport_dtype not in ("", "bfloat16"):
            raise ConfigError(f"--transport-dtype must be '' (the schema's dtype) or 'bfloat16', "
                              f"got {self.transport_dtype!r}")
        if not self.env_retry_s >= 0:
            raise ConfigError(f"--env-retry-s must be 0 (no retries) or positive, got {self.env_retry_s}")
        if not self.heartbeat_interval_s >= 0:
            raise ConfigError(f"--heartbeat-interval-s must be 0 (the aggregator's) or positive, "
                              f"got {self.heartbeat_interval_s}")
        if not 0 <= self.lora_dropout < 1:
            raise ConfigError(f"--lora-dropout must be in [0, 1), got {self.lora_dropout}")
        if not 0.5 <= self.secure_min_threshold < 1:
            raise ConfigError(f"--secure-min-threshold must be in [0.5, 1): a share of the neighbourhood the threshold "
                              f"must exceed, got {self.secure_min_threshold}")
        if self.secure_tolerate_colluders < 0:
            raise ConfigError(f"--secure-tolerate-colluders must be 0 or more, got {self.secure_tolerate_colluders}")
        if not 0 < self.secure_dropout_rate < 1:
            raise ConfigError(f"--secure-dropout-rate must lie strictly between 0 and 1, got {self.secure_dropout_rate}")
        if self.secure_members:  # read and checked now, as the TLS files are: a bad list stops the start
            from services.client_agent.federation.secure_checks import load_members
            load_members(self.secure_members, self.tls_ca)
        envs = self.env_list()
        if not envs:
            raise ConfigError("--env is empty: name an environment, e.g. maze, or several: maze,wordle")
        if len(set(envs)) != len(envs):
            raise ConfigError(f"--env {self.env!r} names an environment twice; name each once")
        if self.keep not in KEEP_MODES:
            raise ConfigError(f"--keep must be 'successes' (the success filter) or 'all' (no filter), "
                              f"got {self.keep!r}")
        if self.explore_tries < 1:
            raise ConfigError(f"--explore-tries must be at least 1, got {self.explore_tries}")
        if not 0 <= self.expert_share < 1:
            raise ConfigError(f"--expert-share must be in [0, 1): the least share of the training trajectories, "
                              f"got {self.expert_share}")
        if self.round_trajectories < 0:
            raise ConfigError(f"--round-trajectories must be 0 (all, the paper's) or a count, got "
                              f"{self.round_trajectories}")
        from services.client_agent.training.round_lr import round_lr_for
        round_lr_for(self.round_lr)
        from services.client_agent.training.buffer import HISTORIES
        if self.history not in HISTORIES:
            names = ", ".join(repr(name) for name in HISTORIES)
            raise ConfigError(f"--history must be one of {names} ('cumulative' is the paper's; --help says what "
                              f"each trains on), got {self.history!r}")

    def _check_share(self) -> None:
        """--task-share and --task-split (fedse.splits), a ConfigError naming the flag where one is malformed."""
        for flag, check, value in (("--task-share", parse_share, self.task_share),
                                   ("--task-split", split_for, self.task_split)):
            try:
                check(value)
            except ConfigError as exc:
                raise ConfigError(f"{flag}: {exc}") from None

    @property
    def signs_keys(self) -> bool:
        """With its mTLS files this client signs its keys in secure rounds and requires everyone's signed."""
        return bool(self.tls_ca and self.tls_cert and self.tls_key)

    def scoring_of(self, env: str) -> str:
        """The rule --scoring gives environment `env` (its own, else the bare rule, else sum)."""
        rules = scoring_rules(self.scoring)
        return rules.get(env, rules[""])

    def env_list(self) -> list[str]:
        """The environments this client holds, in the order given."""
        return [e.strip() for e in self.env.split(",") if e.strip()]

    def lora_targets(self) -> str | list[str]:
        if self.target_modules == "all-linear":
            return "all-linear"
        return [m.strip() for m in self.target_modules.split(",") if m.strip()]
