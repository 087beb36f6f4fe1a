"""The learning rate each round trains at (--round-lr), an object chosen by name as the strategies
are: `constant` (--lr every round, the paper's), `cosine` (--lr at round 0, falling along a half
cosine to a tenth of it at the run's last round) and `halving:K` (--lr halved every K rounds).

Within a round the trainer's own schedule (warm-up, then cosine to zero over the round's steps)
applies to the round's rate. A later round's adapter starts from the average of adapters that were
trained on more and more of the same data: a falling rate is the usual way to keep it from
overshooting what the average found.
"""

from __future__ import annotations

import math

from fedse.config import ConfigError


class RoundLR:
    """The rate round `round_` of `num_rounds` trains at, given --lr."""

    name = ""

    def rate(self, lr: float, round_: int, num_rounds: int) -> float:
        raise NotImplementedError


class Constant(RoundLR):
    name = "constant"

    def rate(self, lr: float, round_: int, num_rounds: int) -> float:
        return lr


class Cosine(RoundLR):
    name = "cosine"
    FLOOR = 0.1  # the last round's rate, as a share of --lr

    def rate(self, lr: float, round_: int, num_rounds: int) -> float:
        progress = min(1.0, round_ / max(1, num_rounds - 1))
        return lr * (self.FLOOR + (1 - self.FLOOR) * 0.5 * (1 + math.cos(math.pi * progress)))


class Halving(RoundLR):
    def __init__(self, every: int):
        self.every = every
        self.name = f"halving:{every}"

    def rate(self, lr: float, round_: int, num_rounds: int) -> float:
        return lr * 0.5 ** (round_ // self.every)


def round_lr_for(name: str) -> RoundLR:
    """The schedule --round-lr names; a ConfigError that names the choices otherwise."""
    if name in ("constant", "cosine"):
        return Constant() if name == "constant" else Cosine()
    head, _, every = name.partition(":")
    if head == "halving" and every.isdigit() and int(every) >= 1:
        return Halving(int(every))
    raise ConfigError(f"--round-lr must be 'constant', 'cosine' or 'halving:K' (K rounds, at least 1), got {name!r}")
