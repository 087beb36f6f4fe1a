"""Fixed-point encoding of adapter values in Z_2^64, for sums the aggregator must not see term by term.

Secure aggregation adds each client's values under masks that cancel only in the sum, so the values
must live in a ring where addition wraps: unsigned 64-bit integers, whose arithmetic wraps for free.
A value x is encoded as round(x * 2^FRACTION_BITS) in two's complement; the wrapped sum of K
encodings, read back as a signed integer and divided by 2^FRACTION_BITS, is the sum of the K values.

The bound, for K <= MAX_CLIENTS values each within [-CLIP, CLIP]:
- each encoding is off by at most 2^-(FRACTION_BITS+1) = 2^-41 (about 4.5e-13), so the sum is off by
  at most K * 2^-41 and the mean by at most 2^-41, plus float64's own rounding of the result (2^-53
  of its magnitude);
- the true sum's magnitude is at most K * CLIP * 2^FRACTION_BITS <= 2^62 < 2^63, so it never wraps
  past what a signed 64-bit integer reads back.
A weighted sum is made in the ring too, never in floating point: w * enc(x) for an integer weight
0 <= w <= CLIP (`times`), which is enc(w * x) off by at most w * 2^-41; with each |w * x| <= CLIP the
terms stay within 2^52 + 2^11 and K <= MAX_CLIENTS of them below 2^63, and sum_k w_k enc(x_k) /
sum_k w_k is the weighted mean within 2^-41, as the plain mean is.
LoRA weights are far inside CLIP = 4096, and 2^-41 is below 1e-6 of any tensor whose largest value
exceeds 4.6e-7 (an all-zero tensor, such as a fresh LoRA B, is encoded exactly). Values outside the
range, and values that are not finite, are refused rather than clipped: a silently changed adapter
is worse than a refused one.
"""

from __future__ import annotations

import numpy as np

FRACTION_BITS = 40
CLIP = 2.0 ** 12
MAX_CLIENTS = 1 << 10
SCALE = float(1 << FRACTION_BITS)
# The most the mean of decoded values can differ from the mean of the values themselves, besides
# float64's rounding of the result.
MEAN_ERROR_BOUND = 2.0 ** -(FRACTION_BITS + 1)


def check(values: np.ndarray) -> np.ndarray:
    """The values as float64; ValueError for a value that is not finite or lies outside [-CLIP, CLIP]."""
    x = np.asarray(values, dtype=np.float64)
    if not np.isfinite(x).all():
        raise ValueError("cannot encode a value that is not finite (NaN or infinity)")
    if x.size and np.abs(x).max() > CLIP:
        raise ValueError(f"cannot encode {np.abs(x).max():.6g}: values must lie within ±{CLIP:g}")
    return x


def encode(values: np.ndarray) -> np.ndarray:
    """The values as uint64 ring elements; ValueError for a value that is not finite or lies outside
    [-CLIP, CLIP]."""
    return np.rint(check(values) * SCALE).astype(np.int64).view(np.uint64)


def times(encoded: np.ndarray, weight: int) -> np.ndarray:
    """weight * encoded in Z_2^64 (wrapping), as a new array: an exact weighted term for an integer
    weight (the caller keeps weight * value within [-CLIP, CLIP], so that a sum of them does not wrap
    past what reads back). ValueError for a weight that is not an integer in 0..CLIP."""
    if isinstance(weight, bool) or int(weight) != weight or not 0 <= weight <= CLIP:
        raise ValueError(f"cannot weigh by {weight!r}: a weight must be a whole number from 0 to {CLIP:g}")
    return np.multiply(np.asarray(encoded, dtype=np.uint64), np.uint64(int(weight)), dtype=np.uint64)


def add(total: np.ndarray, term: np.ndarray) -> np.ndarray:
    """total + term in Z_2^64 (wrapping), as a new array."""
    return np.add(total, term, dtype=np.uint64)


def subtract(total: np.ndarray, term: np.ndarray) -> np.ndarray:
    """total - term in Z_2^64 (wrapping), as a new array."""
    return np.subtract(total, term, dtype=np.uint64)


def decode_sum(total: np.ndarray, count: int) -> np.ndarray:
    """The float64 sum that the wrapped sum `total` of `count` encodings stands for; ValueError where
    count is outside 1..MAX_CLIENTS, for which the bound above does not hold."""
    if not 1 <= count <= MAX_CLIENTS:
        raise ValueError(f"a sum of {count} encodings: fixed-point sums hold 1 to {MAX_CLIENTS} terms")
    return np.asarray(total, dtype=np.uint64).view(np.int64).astype(np.float64) / SCALE
