"""How the members of one environment share its training tasks: each member trains on a disjoint
share of them, and together they hold them all (the held-out test tasks are not split: every
member evaluates the same ones).

A split is chosen by name, as aggregation strategies are (`split_for`):

    iid              a seeded shuffle of the tasks dealt round-robin: every member gets a share of
                     the same size (give or take one) and about the same mix of task types
    dirichlet:ALPHA  the usual non-IID federated setting (label skew): for each task type, the shares
                     of the members are drawn from a symmetric Dirichlet(ALPHA) and that type's
                     tasks dealt out in those proportions. A small ALPHA (0.1) gives each member a few
                     types, most of them its own; a large one (100) is close to iid

Every member computes its own share, alone, from what all of them know: the environment's training
task ids (as the env server lists them), their types, the number of members and the run's seed.
So one seed gives one partition, the same in every member's process, and another seed another.

A task's type (`task_type`) is what the client can tell from its id without asking the env server
more than its task list (the protocol carries no type):

    babyai           its BabyAI level: AgentGym numbers the tasks of its 40 levels so that task id
                     `i` is level `i % 40` (envs/babyai.py, AGENTGYM_LEVELS); the default 27 levels
                     give 27 types of 30 training tasks each
    any other        a stable hash bucket of the id (crc32 of its decimal text, modulo
                     TYPE_BUCKETS): maze starts, wordle words, textcraft goals and webshop goals
                     have no type a task id shows, so dirichlet skews the members' shares of
                     these TYPE_BUCKETS arbitrary groups (quantity and group skew, not a skew of
                     kinds of task)
"""

from __future__ import annotations

import abc
import math
import random
import re
import zlib
from typing import Sequence

import numpy as np

from fedse.config import ConfigError

# envs/babyai.py's AGENTGYM_LEVELS: task id i is level i % 40 (tests/test_splits.py checks the two agree).
BABYAI_LEVELS = 40
TYPE_BUCKETS = 8  # the types of a task of an environment without a known type: hash buckets of its id
SPLIT_NAMES = ("iid", "dirichlet:ALPHA")
CHOICES = "'iid' or 'dirichlet:ALPHA' (ALPHA > 0, e.g. dirichlet:0.5)"


def task_type(env: str, task_id: int) -> str:
    """The type of task `task_id` of environment `env` (the module docstring says which, and why)."""
    if env == "babyai":
        return f"level{task_id % BABYAI_LEVELS}"
    return f"bucket{zlib.crc32(str(task_id).encode()) % TYPE_BUCKETS}"


def task_types(env: str, task_ids: Sequence[int]) -> list[str]:
    return [task_type(env, i) for i in task_ids]


class Split(abc.ABC):
    """A way to share the training tasks of one environment among its members."""

    name: str

    @abc.abstractmethod
    def owners(self, types: Sequence[str], members: int, seed: int) -> list[int]:
        """The member holding each task (the tasks given by their types, in order)."""

    def share(self, train_ids: Sequence[int], types: Sequence[str], members: int, member: int,
              seed: int) -> list[int]:
        """Member `member`'s (0-based, of `members`) task ids, in the order of `train_ids`: disjoint
        from every other member's, and all the members' together are `train_ids`. `types` gives each
        task's type (task_types), in the same order."""
        if members < 1 or not 0 <= member < members:
            raise ConfigError(f"member {member} of {members}: members must be at least 1 and the member "
                              f"0 to {members - 1}")
        if len(types) != len(train_ids):
            raise ValueError(f"{len(types)} task types for {len(train_ids)} tasks")
        owner = self.owners(list(types), members, seed)
        return [task for task, m in zip(train_ids, owner) if m == member]

    def __repr__(self) -> str:
        return self.name


class IIDSplit(Split):
    """A seeded shuffle of the tasks dealt round-robin: shares of equal size (give or take one)."""

    name = "iid"

    def owners(self, types: Sequence[str], members: int, seed: int) -> list[int]:
        order = list(range(len(types)))
        random.Random(f"iid-split:{seed}").shuffle(order)
        owner = [0] * len(types)
        for dealt, task in enumerate(order):
            owner[task] = dealt % members
        return owner


class DirichletSplit(Split):
    """Per task type, the members' proportions drawn from Dir(alpha) (numpy, seeded) and that type's
    tasks (shuffled) cut in those proportions: every task goes to exactly one member. A member may get
    few tasks, but where there are at least as many tasks as members each gets at least one: a member
    left with none takes one from the member holding most (from that member's commonest type)."""

    def __init__(self, alpha: float):
        if not (alpha > 0 and math.isfinite(alpha)):
            raise ConfigError(f"task split dirichlet:{alpha}: ALPHA must be a positive number; use {CHOICES}")
        self.alpha = alpha
        self.name = f"dirichlet:{alpha:g}"

    def owners(self, types: Sequence[str], members: int, seed: int) -> list[int]:
        rng = np.random.default_rng([seed, 0xD1])
        owner = [0] * len(types)
        for kind in sorted(set(types)):
            tasks = [i for i, t in enumerate(types) if t == kind]
            tasks = [tasks[j] for j in rng.permutation(len(tasks))]
            cuts = np.floor(np.cumsum(rng.dirichlet([self.alpha] * members)) * len(tasks) + 0.5).astype(int)
            start = 0
            for member, end in enumerate(cuts):
                end = len(tasks) if member == members - 1 else min(max(end, start), len(tasks))
                for task in tasks[start:end]:
                    owner[task] = member
                start = end
        return _fill_empty(owner, types, members)


def _fill_empty(owner: list[int], types: Sequence[str], members: int) -> list[int]:
    """`owner` with every member holding a task, where there are enough: each member without one
    takes one (the last) of the commonest type of the member holding most (the first such)."""
    if len(owner) < members:
        return owner
    counts = [owner.count(m) for m in range(members)]
    for empty in [m for m in range(members) if not counts[m]]:
        donor = counts.index(max(counts))
        held = [i for i, m in enumerate(owner) if m == donor]
        kinds = [types[i] for i in held]
        commonest = max(sorted(set(kinds)), key=kinds.count)
        task = [i for i in held if types[i] == commonest][-1]
        owner[task] = empty
        counts[donor] -= 1
        counts[empty] += 1
    return owner


def split_for(name: str) -> Split:
    """The split a name chooses: 'iid' or 'dirichlet:ALPHA'; ConfigError naming the choices otherwise."""
    text = name.strip()
    if text == "iid":
        return IIDSplit()
    kind, sep, value = text.partition(":")
    if kind.strip() == "dirichlet" and sep:
        try:
            alpha = float(value)
        except ValueError:
            raise ConfigError(f"task split {name!r}: ALPHA {value.strip()!r} is not a number; use {CHOICES}") from None
        return DirichletSplit(alpha)
    raise ConfigError(f"unknown task split {name!r}: use {CHOICES}")


def parse_share(text: str) -> tuple[int, int] | None:
    """A task share "K/N" as (K, N): member K (0-based) of N; None for '' (all the tasks); ConfigError
    for anything else, or K not below N."""
    if not text.strip():
        return None
    k, sep, n = text.strip().partition("/")
    if not sep or not k.strip().isdigit() or not n.strip().isdigit():
        raise ConfigError(f"task share {text!r}: write K/N, member K (0-based) of N members, e.g. 0/4; "
                          "or '' for all the tasks")
    member, members = int(k), int(n)
    if members < 1 or member >= members:
        raise ConfigError(f"task share {text!r}: N must be at least 1 and K below N (members are 0 to N-1)")
    return member, members


# The ':N' that ends an --envs entry gives its members, unless it is the port of a URL (an AgentGym
# bridge's http://HOST:PORT): a ':N' after the URL's host is its port, after its port the members.
MEMBERS = re.compile(r"(.*):(\d+)\s*", re.S)
URL_HOST_END = re.compile(r"//[^/?#@:\s]*$")


def split_members(part: str) -> tuple[str, int]:
    """One entry of `fedse run --envs` as (its environment spec, its members: N where it ends in :N,
    else 0), e.g. "wordle?vocab_size=30:4" -> ("wordle?vocab_size=30", 4); ConfigError for a :0.
    "x=agentgym:babyai@http://h:36001" keeps its port; "x=agentgym:babyai@http://h:36001:4" has 4 members."""
    found = MEMBERS.fullmatch(part.strip())
    if found is None or URL_HOST_END.search(found.group(1)):
        return part.strip(), 0
    if int(found.group(2)) < 1:
        raise ConfigError(f"--envs {part.strip()!r}: an environment's :N (its members) must be at least 1")
    return found.group(1).strip(), int(found.group(2))


def member_id(prefix: str, k: int, total: int) -> str:
    """Member k's client id among `total` members: PREFIX-KK, zero-padded to two digits or the width
    of total - 1 (org-babyai-00 .. org-babyai-39), the same in `fedse run` and a client host."""
    return f"{prefix}-{k:0{max(2, len(str(total - 1)))}d}"
