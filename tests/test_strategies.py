"""Aggregation maths on hand-computed tensors (Prepare / Execute / Assert)."""

import pytest
import torch

from services.aggregator.strategies import Update, fedavg, weighted_average, weighted_by_successes

A, B = "m.lora_A.weight", "m.lora_B.weight"


def update(cid: str, a: list, b: list, successes: int) -> Update:
    return Update(cid, {A: torch.tensor(a), B: torch.tensor(b)}, num_examples=10, num_successes=successes)


def test_fedavg_averages_a_and_b_separately():
    u1 = update("c1", [[1.0, 2.0]], [[4.0], [0.0]], successes=1)
    u2 = update("c2", [[3.0, 6.0]], [[0.0], [2.0]], successes=3)
    out = fedavg([u1, u2])
    assert torch.equal(out[A], torch.tensor([[2.0, 4.0]]))
    assert torch.equal(out[B], torch.tensor([[2.0], [1.0]]))
    # Averaging factors is not averaging products: mean(B_k A_k) differs from mean(B) mean(A).
    mean_products = (u1.adapter[B] @ u1.adapter[A] + u2.adapter[B] @ u2.adapter[A]) / 2
    assert not torch.allclose(out[B] @ out[A], mean_products)


def test_weighted_by_successes_uses_success_counts():
    u1 = update("c1", [[1.0, 2.0]], [[4.0], [0.0]], successes=1)
    u2 = update("c2", [[3.0, 6.0]], [[0.0], [2.0]], successes=3)
    out = weighted_by_successes([u1, u2])
    # (1*1 + 3*3)/4 = 2.5, (1*2 + 3*6)/4 = 5; B: (1*4 + 0)/4 = 1, (0 + 3*2)/4 = 1.5
    assert torch.equal(out[A], torch.tensor([[2.5, 5.0]]))
    assert torch.equal(out[B], torch.tensor([[1.0], [1.5]]))


def test_weighted_without_successes_falls_back_to_plain_mean():
    u1 = update("c1", [[1.0]], [[1.0]], successes=0)
    u2 = update("c2", [[3.0]], [[5.0]], successes=0)
    assert torch.equal(weighted_by_successes([u1, u2])[A], torch.tensor([[2.0]]))


def test_weighted_average_keeps_dtype_and_refuses_nonsense():
    out = weighted_average([{A: torch.ones(2, dtype=torch.bfloat16)}], [2.0])
    assert out[A].dtype == torch.bfloat16
    with pytest.raises(ValueError):
        weighted_average([], [])
    with pytest.raises(ValueError):
        weighted_average([{A: torch.ones(1)}], [0.0])
