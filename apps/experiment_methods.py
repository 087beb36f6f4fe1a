"""`fedse experiment`'s methods, budgets and settings: what each method changes in Fed-SE's run
(Method, METHODS), what --methods accepts (GROUPS), what a run of each budget costs (BUDGETS), and
ExperimentConfig, the command's flags and the RunConfig of each (method, seed) they give."""

from __future__ import annotations

import dataclasses
import pathlib
from typing import Any

from fedse.config import ALL, ConfigError, Count, field, refuse_zero
from apps.planning import RunConfig, env_specs
from fedse.model.pretrained import check_base_model


@dataclasses.dataclass(frozen=True)
class Method:
    key: str  # what --methods names
    name: str  # what the table shows
    group: str  # "main" (Table 1) or "ablation"
    settings: dict[str, Any]  # the RunConfig fields that make it differ from Fed-SE


METHODS: tuple[Method, ...] = (
    Method("local", "Local", "main", {"topology": "local", "explore_tasks": 0}),
    Method("centralized", "Centralized", "main", {"topology": "centralized", "explore_tasks": 0}),
    Method("fedit", "FedIT", "main", {"explore_tasks": 0}),
    Method("fedse", "Fed-SE", "main", {}),
    Method("no-filter", "w/o success filter", "ablation", {"keep": "all"}),
    Method("no-history", "w/o history", "ablation", {"history": "round"}),
    Method("weighted", "weighted averaging", "ablation", {"strategy": "weighted"}),
    Method("rank2", "LoRA rank 2", "ablation", {"lora_r": 2, "lora_alpha": 4}),
    Method("rank4", "LoRA rank 4", "ablation", {"lora_r": 4, "lora_alpha": 8}),
    Method("rank16", "LoRA rank 16", "ablation", {"lora_r": 16, "lora_alpha": 32}),
    # Fed-SE with half the clients a round, chosen by each selector (Fed-SE itself takes every client).
    Method("sample", "sample half", "selection", {"selector": "sample", "selection_fraction": 0.5}),
    Method("utility", "utility (Oort) half", "selection", {"selector": "utility", "selection_fraction": 0.5}),
    Method("agent-tools", "agent-tools half", "selection", {"selector": "agent-tools", "selection_fraction": 0.5}),
    Method("agent-llm", "agent-llm half", "selection", {"selector": "agent-llm", "selection_fraction": 0.5}),
    # FedBuff: clients train when they can; each version folds half the clients' uploads (or --per-round's).
    Method("async", "FedBuff (async) half", "selection", {"mode": "async"}),
    # Fed-SE with one part of its round changed, within the method (--methods variants).
    Method("tries3", "3 tries per task", "variants", {"explore_tries": 3}),
    Method("lr-cosine", "rate falling over rounds", "variants", {"round_lr": "cosine"}),
    Method("expert-half", "demonstrations kept at half", "variants", {"expert_share": 0.5}),
    Method("explore-cool", "exploring at temperature 0.5", "variants", {"temperature": 0.5}),
    Method("shortest", "shortest success per task", "variants", {"history": "shortest"}),
    Method("cap40", "at most 40 trajectories a round", "variants", {"round_trajectories": 40}),
    # Fed-SE with clients at mixed LoRA ranks (4, 16, 8 in turn; Fed-SE itself: every client at rank 8).
    Method("hlora", "hlora, ranks 4/16/8", "ranks", {"strategy": "hlora", "lora_ranks": "4,16,8"}),
    Method("zero-pad", "zero-pad, ranks 4/16/8", "ranks", {"strategy": "zero-pad", "lora_ranks": "4,16,8"}),
    Method("flexlora", "flexlora, ranks 4/16/8", "ranks", {"strategy": "flexlora", "lora_ranks": "4,16,8"}),
)
BY_KEY = {m.key: m for m in METHODS}
# What --methods accepts besides method keys.
GROUPS = {"all": [m.key for m in METHODS if m.group not in ("selection", "ranks", "variants")],
          "variants": ["fedse"] + [m.key for m in METHODS if m.group == "variants"],
          "selectors": ["fedse"] + [m.key for m in METHODS if m.group == "selection" and m.key != "async"],
          # Many members, a few a round (--envs NAME:N, --per-round): who takes part, and rounds that do not wait.
          "at-scale": ["sample", "agent-tools", "async"],
          "ranks": ["fedse", "hlora", "zero-pad"]}
PRETRAINED = "Pre-trained"

# Budgets: what a run of each method costs. "quick" is sized to finish every method for every seed
# in under 15 minutes on a 2-core CPU machine with the embedded tiny model; "cpu-real" runs the
# paper's table (no ablations) with SmolLM2-135M on a 2-core CPU in about 2 hours; "full" is for a
# GPU machine and a real model (--base-model /path/to/model): all five environments and all test tasks.
# "long" is the paper's T = 20 rounds with the tiny model on all five environments, three seeds and 20
# test tasks each (a task is 5 points): hours on a 2-core CPU, resumed by running it again; "long-real"
# is the same for SmolLM2-135M on three environments, sized for a GPU (on 2 CPU cores: days).
BUDGETS: dict[str, dict[str, Any]] = {
    "quick": {"envs": "maze,wordle?vocab_size=30", "methods": "all", "seeds": 2, "rounds": 3, "expert_demos": 10,
              "explore_tasks": 16, "eval_tasks": ALL, "epochs": 2, "lr": 3e-3},
    "cpu-real": {"envs": "maze,babyai", "methods": "local,centralized,fedit,fedse", "seeds": 1, "rounds": 1,
                 "expert_demos": 10, "explore_tasks": 8, "eval_tasks": 10, "epochs": 2, "lr": 2e-3},
    "long": {"envs": "maze,wordle,babyai,textcraft,webshop", "methods": "local,centralized,fedit,fedse", "seeds": 3,
             "rounds": 20, "expert_demos": 20, "explore_tasks": 16, "eval_tasks": 20, "epochs": 2, "lr": 3e-3},
    "long-real": {"envs": "babyai,maze,wordle", "methods": "local,centralized,fedit,fedse", "seeds": 3, "rounds": 20,
                  "expert_demos": 10, "explore_tasks": 8, "eval_tasks": 20, "epochs": 2, "lr": 2e-3},
    "full": {"envs": "babyai,webshop,textcraft,maze,wordle", "methods": "all", "seeds": 3, "rounds": 5,
             "expert_demos": 20, "explore_tasks": 32, "eval_tasks": ALL, "epochs": 2, "lr": 3e-3},
}
BUDGET_FIELDS = ("envs", "seeds", "rounds", "expert_demos", "explore_tasks", "eval_tasks", "epochs")


@dataclasses.dataclass(frozen=True)
class ExperimentConfig:
    """Runs Pre-trained, Local, Centralized, FedIT, Fed-SE and Fed-SE's ablations over several seeds and
    writes the paper-style table, a CSV and plots. Numbers left at -1 (or empty) take the budget's."""

    budget: str = field("quick", "'quick' (under 15 min on a 2-core CPU with the tiny model), 'cpu-real' "
                                 "(SmolLM2-135M on a 2-core CPU, the paper's table without ablations, about two "
                                 "hours), 'long' (the tiny model, 20 rounds, five environments, three seeds: hours), "
                                 "'long-real' (the same for a real model on three environments: a GPU's) or 'full' "
                                 "(GPU machine, real model: all five environments, all test tasks)")
    methods: str = field("", "comma-separated subset of: " + ", ".join(m.key for m in METHODS)
                             + " ('all' = the paper's methods and ablations; 'selectors' = fedse and the client "
                               "selectors, each taking half the clients a round; 'at-scale' = sample, "
                               "agent-tools and FedBuff (async) for many members, NAME:N in --envs, each "
                               "taking --per-round a round; 'ranks' = fedse at rank 8 beside "
                               "hlora and zero-pad with clients at ranks 4, 16 and 8; 'variants' = fedse beside 3 "
                               "tries per exploration task, a rate falling over the rounds, the demonstrations "
                               "kept at half the training data, exploration at temperature 0.5, training on "
                               "each task's shortest success and on at most 40 trajectories a round; "
                               "Pre-trained comes with fedse; '' = the budget's)")
    results: str = field("results/experiment", "folder for table.md, results.csv, the plots and each run")
    base_model: str = field("fedse-tiny", "'fedse-tiny' (built in code) or a local Hugging Face model directory "
                                          "(`make model` writes models/smollm2-135m-instruct)")
    lr: float = field(-1.0, "client learning rate (the paper's 5e-5 suits 7B models; -1 = the budget's)")
    envs: str = field("", "environment specs, one client each, as fedse run --envs takes them ('' = the budget's)")
    seeds: int = field(-1, "repeats with seeds 0..N-1 (-1 = the budget's)")
    rounds: int = field(-1, "federated rounds T (-1 = the budget's)")
    expert_demos: int = field(-1, "expert demonstrations per environment (-1 = the budget's)")
    explore_tasks: int = field(-1, "Fed-SE's exploration tasks per client and round (-1 = the budget's)")
    eval_tasks: Count = field(-1, "held-out test tasks per environment, or 'all' (-1 = the budget's)")
    epochs: int = field(-1, "training epochs per round (-1 = the budget's)")
    per_round: int = field(0, "with the selectors and FedBuff: the clients a round takes (a selector's "
                              "--clients-per-round; FedBuff's buffer, twice that training at once); 0 = half")
    members_per_host: int = field(0, "with members (NAME:N in --envs): run them in client hosts of at most this many "
                                     "(fedse run --members-per-host; 0 = a process each)")
    task_split: str = field("iid", "with members: how they share each environment's training tasks, 'iid' or "
                                   "'dirichlet:ALPHA'")
    fresh: bool = field(False, "run every method again even where a finished run with the same settings exists")
    report: bool = field(False, "run nothing: write the table and figures from the runs already finished with these "
                                "settings (an experiment under way elsewhere, or stopped for good)")

    def __post_init__(self) -> None:
        if self.budget not in BUDGETS:
            raise ConfigError(f"--budget must be one of {', '.join(BUDGETS)}, got {self.budget!r}")
        unknown = [k for k in self.method_keys() if k not in BY_KEY]
        if unknown:
            raise ConfigError(f"--methods: unknown {', '.join(unknown)}; choose from "
                              f"{', '.join(m.key for m in METHODS)}, 'all', 'selectors' or 'ranks'")
        if not self.method_keys():
            raise ConfigError("--methods is empty: name at least one method, or 'all'")
        if self.lr != -1 and not self.lr > 0:
            raise ConfigError(f"--lr must be positive (or -1: the budget's, {BUDGETS[self.budget]['lr']}), "
                              f"got {self.lr}")
        for name in BUDGET_FIELDS:
            value = getattr(self, name)
            if name != "envs" and value < -1:
                raise ConfigError(f"--{name.replace('_', '-')} must be -1 (the budget's) or at least 0, got {value}")
        refuse_zero(self.eval_tasks, "--eval-tasks", "test task evaluated")
        if self.setting("seeds") < 1 or self.setting("rounds") < 1:
            raise ConfigError("--seeds and --rounds must be at least 1")
        check_base_model(self.base_model)
        if self.report and self.fresh:
            raise ConfigError("--report runs nothing and --fresh runs everything again: give one of them")

    def method_keys(self) -> list[str]:
        methods = self.setting("methods").strip()
        keys = [k.strip() for k in methods.split(",") if k.strip()]
        return list(dict.fromkeys(k for key in keys for k in GROUPS.get(key, [key])))

    def setting(self, name: str) -> Any:
        """A budget field: the flag's value if given, else the budget's."""
        value = getattr(self, name)
        return BUDGETS[self.budget][name] if value in (-1, "") else value

    def env_list(self) -> list[str]:
        """The environments' names (a spec's options and members are not part of its name)."""
        return list(env_specs(self.setting("envs")))

    def run_config(self, method: Method, seed: int, results: pathlib.Path) -> RunConfig:
        common = {name: self.setting(name) for name in BUDGET_FIELDS if name != "seeds"}
        members = {"members_per_host": self.members_per_host, "task_split": self.task_split}
        cfg = RunConfig(results=str(results), base_model=self.base_model, lr=self.setting("lr"), seed=seed,
                        run_name=method.key, **{**common, **members, **method.settings})
        return dataclasses.replace(cfg, **self.taking(method, sum(cfg.members().values())))

    def labelled(self, method: Method) -> Method:
        """The method as the table names it: a selector's or FedBuff's "half" is --per-round's count."""
        if method.group == "selection" and self.per_round:
            return dataclasses.replace(method, name=method.name.replace("half", f"{self.per_round} a round"))
        return method

    def taking(self, method: Method, clients: int) -> dict[str, Any]:
        """How many of the run's `clients` a selector or FedBuff takes a round: --per-round's, else half."""
        if method.group != "selection":
            return {}
        k = self.per_round or max(1, clients // 2)
        if method.settings.get("mode") == "async":
            return {"async_buffer": k, "async_concurrency": min(clients, 2 * k)}
        return {"clients_per_round": k, "selection_fraction": 0.0} if self.per_round else {}
