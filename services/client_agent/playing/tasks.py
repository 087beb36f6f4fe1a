"""The environments a client holds: what each offers (ListEnvironments) and which of its tasks the
client trains and evaluates on."""

from __future__ import annotations

import dataclasses
import logging

from fedse.splits import parse_share, split_for, task_types
from fedse.transport.serving import log_fields

from services.client_agent.playing.envclient import EnvClient, EnvInfo

log = logging.getLogger("client_agent")


@dataclasses.dataclass(frozen=True)
class EnvTasks:
    """One environment this client holds: its env server client, its training tasks, the test
    tasks it evaluates, and what it offers (an expert; listed actions, else the agent writes them)."""

    env: EnvClient
    train_ids: list[int]
    test_ids: list[int]
    has_expert: bool = True
    lists_actions: bool = True

    @property
    def name(self) -> str:
        return self.env.env


def env_tasks(env: EnvClient, eval_tasks: int, info: EnvInfo | None = None, share: str = "", split: str = "iid",
              seed: int = 0) -> EnvTasks:
    """The environment's training tasks (this member's share of them: `share` "K/N" of `split`, from
    `seed`, as share_of; all of them for ''), the test tasks evaluated (the first `eval_tasks`, all for
    ALL; every member's the same) and its capabilities (`info`, from ListEnvironments; an expert and
    listed actions if not given)."""
    info = info or EnvInfo(env.env)
    train_ids, _ = env.tasks("train")
    test_ids, _ = env.tasks("test")
    return EnvTasks(env, share_of(env.env, train_ids, share, split, seed),
                    test_ids[:eval_tasks] if eval_tasks else test_ids,
                    has_expert=info.has_expert, lists_actions=info.lists_actions)


def share_of(env: str, train_ids: list[int], share: str, split: str, seed: int) -> list[int]:
    """Member K's share of environment `env`'s training tasks, where `share` is "K/N" (--task-share): the
    `split` (--task-split) of them among N members by their types (fedse.splits), from `seed`, which every
    member of the run has, so that the members' shares are disjoint and together all the tasks; logged.
    All of them for share ''."""
    member = parse_share(share)
    if member is None:
        return train_ids
    k, n = member
    mine = split_for(split).share(train_ids, task_types(env, train_ids), n, k, seed)
    log.info("task share", extra=log_fields(env=env, member=k, members=n, split=split, seed=seed,
                                            train_tasks=len(mine), of=len(train_ids)))
    return mine


def writing(infos: dict[str, EnvInfo]) -> set[str]:
    """The environments that list no actions: the agent writes its actions there."""
    return {name for name, info in infos.items() if not info.lists_actions}


def capabilities(envs: list[EnvClient], env_server: str, write_tokens: int, tiny: bool,
                 base_model: str) -> dict[str, EnvInfo]:
    """What each of the environments offers (ListEnvironments of `envs[0]`'s env server, at
    `env_server`), logged, with a warning where the tiny model must write its actions."""
    hosted = envs[0].environments()
    missing = [e.env for e in envs if e.env not in hosted]
    if missing:
        raise RuntimeError(f"the env server at {env_server} hosts {', '.join(hosted) or 'nothing'}, "
                           f"not {', '.join(missing)}: fix --env or the env server's --envs")
    infos = {e.env: hosted[e.env] for e in envs}
    writes = sorted(writing(infos))
    for name, info in infos.items():
        log.info("environment", extra=log_fields(env=name, has_expert=info.has_expert,
                                                 lists_actions=info.lists_actions, max_turns=info.max_turns))
        if not info.lists_actions:
            log.info("the environment lists no actions: the agent writes each action as ReAct text "
                     "(\"Thought: ... Action: ...\"), whatever --policy says, and the action parsed from it is "
                     "sent", extra=log_fields(env=name, max_new_tokens=write_tokens))
    if writes and tiny:
        log.warning("the embedded tiny model cannot learn where it must write its actions: a byte-level model "
                    "built in code from random weights does not write valid actions without a list to choose "
                    "from, so this run will learn nothing in these environments (it runs, and "
                    "parseable_action_rate shows how rarely its text names an action); use a real model, e.g. "
                    "--base-model models/smollm2-135m-instruct (`make model`)",
                    extra=log_fields(envs=writes, base_model=base_model))
    return infos
