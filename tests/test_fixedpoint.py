"""Fixed-point sums in Z_2^64 (fedse/privacy/fixedpoint.py): the wrapped sum of encodings decodes to the sum
of the values within the stated bound, for 1 to MAX_CLIENTS terms, with masks that cancel only in
the sum; values it cannot hold are refused."""

from __future__ import annotations

import numpy as np
import pytest

from fedse.privacy import fixedpoint as fp


def masked_mean(values: list[np.ndarray], rng: np.random.Generator) -> np.ndarray:
    """The mean the aggregator decodes from masked encodings: each pair (i, j) shares a random mask
    that i adds and j subtracts, so no single upload reveals its values, and the masks cancel in the sum."""
    uploads = [fp.encode(v) for v in values]
    for i in range(len(uploads)):
        for j in range(i + 1, min(i + 4, len(uploads))):  # a few neighbours each, as a sparse graph has
            mask = rng.integers(0, 2 ** 64, size=values[0].shape, dtype=np.uint64, endpoint=False)
            uploads[i] = fp.add(uploads[i], mask)
            uploads[j] = fp.subtract(uploads[j], mask)
    total = np.zeros(values[0].shape, dtype=np.uint64)
    for u in uploads:
        total = fp.add(total, u)
    return fp.decode_sum(total, len(values)) / len(values)


@pytest.mark.parametrize("clients", [1, 2, 5, 1000, fp.MAX_CLIENTS])
def test_the_masked_fixed_point_mean_is_the_plain_mean_within_the_bound(clients):
    rng = np.random.default_rng(clients)
    cases = {
        "LoRA-like": [rng.normal(0, 0.02, size=64) for _ in range(clients)],
        "unit": [rng.uniform(-1, 1, size=64) for _ in range(clients)],
        "at the clip": [np.full(64, fp.CLIP) for _ in range(clients)],  # the largest sum the range allows
        "zero": [np.zeros(64) for _ in range(clients)],  # a fresh LoRA B
    }
    for name, values in cases.items():
        exact = np.mean(values, axis=0)
        got = masked_mean(values, rng)
        error = np.abs(got - exact)
        assert (error <= fp.MEAN_ERROR_BOUND + 2.0 ** -52 * np.abs(exact)).all(), (name, error.max())
        largest = np.abs(exact).max()
        if largest > 0:
            assert error.max() <= 1e-6 * largest
        else:
            assert (got == 0).all()  # zeros are encoded exactly


def test_a_single_upload_does_not_show_its_values():
    rng = np.random.default_rng(0)
    value = np.full(1000, 0.01)
    mask = rng.integers(0, 2 ** 64, size=1000, dtype=np.uint64)
    upload = fp.add(fp.encode(value), mask)
    # The masked upload decodes to noise spread over the whole ring, not to the value.
    decoded = fp.decode_sum(upload, 1)
    assert np.abs(decoded - 0.01).min() > 1.0 and np.std(decoded) > 1e5
    assert np.array_equal(fp.subtract(upload, mask), fp.encode(value))


def test_values_it_cannot_hold_are_refused():
    with pytest.raises(ValueError, match="not finite"):
        fp.encode(np.array([0.0, np.nan]))
    with pytest.raises(ValueError, match="not finite"):
        fp.encode(np.array([np.inf]))
    with pytest.raises(ValueError, match="within"):
        fp.encode(np.array([fp.CLIP * 1.5]))
    total = fp.encode(np.zeros(3))
    for count in (0, fp.MAX_CLIENTS + 1):
        with pytest.raises(ValueError, match="terms"):
            fp.decode_sum(total, count)
