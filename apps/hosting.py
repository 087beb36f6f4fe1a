"""`fedse run`'s client hosts: with --members-per-host M, the members of an environment (--clients, or
NAME:N in --envs) run in client hosts (`fedse client-host`, one process over one model each) of at
most M members, instead of one client process each. An environment's n members go to ceil(n / M)
hosts; host h holds members h, h + H, h + 2H, ... (H hosts: as a StatefulSet's pods do), so every
member keeps the id, task share and state directory it has as a process of its own. A client that
is not a member (one per environment) stays a process of its own."""

from __future__ import annotations

import dataclasses
import math
import re

from apps.planning import Client, Federation
from services.client_agent.config import ClientConfig
from services.client_host.config import HostConfig

FAILED_MEMBER = re.compile(r"^member (\S+) failed: ", re.M)  # what a host says of each member that failed


@dataclasses.dataclass(frozen=True)
class HostPlan:
    """One client host of a run: its process name, its environment and members."""

    name: str
    env: str
    clients: tuple[Client, ...]
    offset: int
    stride: int
    total: int


def host_plans(fed: Federation, per_host: int) -> list[HostPlan]:
    """The client hosts of `fed`'s members (none with per_host 0)."""
    if per_host < 1:
        return []
    by_env: dict[str, list[Client]] = {}
    for c in fed.clients:
        if c.share:
            by_env.setdefault(c.envs[0], []).append(c)
    plans = []
    for env, members in by_env.items():
        hosts = math.ceil(len(members) / per_host)
        plans += [HostPlan(f"client_host-{env}-{h}", env, tuple(members[h::hosts]), h, hosts, len(members))
                  for h in range(hosts)]
    return plans


def host_config(member: ClientConfig, plan: HostPlan) -> HostConfig:
    """The host of `plan`, from its first member's client config (the settings every member shares)."""
    shared = {f.name: getattr(member, f.name) for f in dataclasses.fields(ClientConfig)
              if f.name not in ("client_id", "task_share")}
    host = HostConfig(**shared, client_id=f"org-{plan.env}", members=len(plan.clients), member_offset=plan.offset,
                      member_stride=plan.stride, members_total=plan.total)
    assert [c.client_id for c in host.member_configs()] == [c.client_id for c in plan.clients], plan
    return host


def failed_members(log_text: str, members: list[str]) -> list[str]:
    """The members a host that exited non-zero lost: those it names as failed, else (it died before it
    could say: a signal, the out-of-memory killer) every one."""
    named = [m for m in FAILED_MEMBER.findall(log_text) if m in members]
    return named or members
