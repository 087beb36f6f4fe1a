"""Differential-privacy accounting of the published adapters: (epsilon, delta) per round and in total.

With clipping to L2 norm C and Gaussian noise of std z * C on the sum of the updates (the aggregator's
central noise, or with secure aggregation the clients' shares of it), each published global adapter
is one release of the Gaussian mechanism with noise multiplier z. The accounting is its
zero-concentrated differential privacy (Bun and Steinke 2016, "Concentrated Differential Privacy:
Simplifications, Extensions, and Lower Bounds"):

- one release is rho-zCDP with rho = 1 / (2 z^2) (Proposition 1.6);
- releases compose by adding their rho: R rounds are (R rho)-zCDP (Lemma 1.7);
- rho-zCDP implies (epsilon, delta)-DP for every delta in (0, 1) with
  epsilon = rho + 2 sqrt(rho ln(1/delta)) (Proposition 1.3).

zCDP is used because it composes exactly and in closed form, so the total never needs a numerical
accountant; its epsilon is a valid upper bound, somewhat looser than an RDP or PLD accountant's.
No noise (z = 0) is no privacy: rho and epsilon are infinite.
"""

from __future__ import annotations

import math


def zcdp_rho(noise_multiplier: float) -> float:
    """rho of one Gaussian release with std noise_multiplier times its sensitivity: 1 / (2 z^2)."""
    if not noise_multiplier >= 0:  # NaN too
        raise ValueError(f"the noise multiplier must be a number >= 0, got {noise_multiplier}")
    return math.inf if noise_multiplier == 0 else 1.0 / (2.0 * noise_multiplier ** 2)


def epsilon(rho: float, delta: float) -> float:
    """The epsilon of (epsilon, delta)-DP that rho-zCDP implies: rho + 2 sqrt(rho ln(1/delta))."""
    if not 0 < delta < 1:
        raise ValueError(f"delta must lie strictly between 0 and 1, got {delta}")
    if not rho >= 0:
        raise ValueError(f"rho must be a number >= 0, got {rho}")
    return rho + 2.0 * math.sqrt(rho * math.log(1.0 / delta))


def epsilons(noise_multiplier: float, releases: int, delta: float) -> tuple[float, float]:
    """(epsilon of one release, epsilon of `releases` of them composed), both at `delta`."""
    if releases < 0:
        raise ValueError(f"releases must be 0 or more, got {releases}")
    rho = zcdp_rho(noise_multiplier)
    return epsilon(rho, delta), epsilon(releases * rho, delta) if releases else 0.0
