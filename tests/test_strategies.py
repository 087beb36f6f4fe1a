"""Aggregation maths on hand-computed tensors (Prepare / Execute / Assert)."""

import pytest
import torch

from fedse.model.adapter import encode
from services.aggregator.adapter_files import AdapterFile
from services.aggregator.strategies import (
    BY_NAME,
    STRATEGIES,
    StrategyParams,
    Update,
    aggregate,
    validate_params,
)

A, B = "m.lora_A.weight", "m.lora_B.weight"


def update(cid: str, a: list, b: list, successes: int = 1) -> Update:
    return Update(cid, {A: torch.tensor(a), B: torch.tensor(b)}, num_examples=10, num_successes=successes)


def single(cid: str, values: list) -> Update:
    """An update holding one tensor, for coordinate-wise strategies."""
    return Update(cid, {A: torch.tensor(values)}, num_examples=10, num_successes=1)


def zeros_like(u: Update) -> dict:
    return {name: torch.zeros_like(t) for name, t in u.adapter.items()}


def fedavg(updates: list[Update]) -> dict:
    return aggregate("fedavg", updates, updates[0].adapter)


def weighted(updates: list[Update]) -> dict:
    return aggregate("weighted", updates, updates[0].adapter)


def product(out: dict) -> torch.Tensor:
    return out[B].double() @ out[A].double()


# ---- fedavg and weighted ----------------------------------------------------------------------

def test_fedavg_averages_a_and_b_separately():
    u1 = update("c1", [[1.0, 2.0]], [[4.0], [0.0]], successes=1)
    u2 = update("c2", [[3.0, 6.0]], [[0.0], [2.0]], successes=3)
    out = fedavg([u1, u2])
    assert torch.equal(out[A], torch.tensor([[2.0, 4.0]]))
    assert torch.equal(out[B], torch.tensor([[2.0], [1.0]]))
    # Averaging factors is not averaging products: mean(B_k A_k) differs from mean(B) mean(A).
    mean_products = (u1.adapter[B] @ u1.adapter[A] + u2.adapter[B] @ u2.adapter[A]) / 2
    assert not torch.allclose(out[B] @ out[A], mean_products)


def test_aggregate_follows_the_previous_adapters_key_order():
    u1 = update("c1", [[1.0, 2.0]], [[4.0], [0.0]])
    u2 = update("c2", [[3.0, 6.0]], [[0.0], [2.0]])
    previous = {B: torch.zeros(2, 1), A: torch.zeros(1, 2)}  # B first on purpose
    out = aggregate("fedavg", [u1, u2], previous)
    assert list(out) == [B, A]
    assert torch.equal(out[A], torch.tensor([[2.0, 4.0]])) and torch.equal(out[B], torch.tensor([[2.0], [1.0]]))


def test_weighted_by_successes_uses_success_counts():
    u1 = update("c1", [[1.0, 2.0]], [[4.0], [0.0]], successes=1)
    u2 = update("c2", [[3.0, 6.0]], [[0.0], [2.0]], successes=3)
    out = weighted([u1, u2])
    # (1*1 + 3*3)/4 = 2.5, (1*2 + 3*6)/4 = 5; B: (1*4 + 0)/4 = 1, (0 + 3*2)/4 = 1.5
    assert torch.equal(out[A], torch.tensor([[2.5, 5.0]]))
    assert torch.equal(out[B], torch.tensor([[1.0], [1.5]]))


def test_weighted_without_successes_falls_back_to_plain_mean():
    u1 = update("c1", [[1.0]], [[1.0]], successes=0)
    u2 = update("c2", [[3.0]], [[5.0]], successes=0)
    assert torch.equal(weighted([u1, u2])[A], torch.tensor([[2.0]]))


def test_weighted_keeps_the_dtype_and_refuses_an_empty_round():
    one = Update("c1", {A: torch.ones(2, dtype=torch.bfloat16)}, num_examples=1, num_successes=2)
    assert weighted([one])[A].dtype == torch.bfloat16
    with pytest.raises(ValueError, match="nothing to aggregate"):
        aggregate("weighted", [], {A: torch.ones(2)})


def test_weighted_refuses_negative_success_counts():
    u1 = update("c1", [[1.0]], [[1.0]], successes=5)
    u2 = update("c2", [[0.0]], [[0.0]], successes=-3)
    with pytest.raises(ValueError, match="must not be negative"):
        weighted([u1, u2])


def test_strategies_lists_the_command_line_names_with_descriptions():
    assert list(STRATEGIES) == ["fedavg", "weighted", "exact", "hlora", "flexlora", "zero-pad", "median", "trimmed_mean"]
    assert all(isinstance(d, str) and d for d in STRATEGIES.values())


# ---- median and trimmed mean ------------------------------------------------------------------

def test_median_odd_k_takes_the_middle_value():
    # Prepare: K = 3; coordinate 0 holds 1, 5, 2; coordinate 1 holds -4, 0, 7.
    updates = [single("c1", [1.0, -4.0]), single("c2", [5.0, 0.0]), single("c3", [2.0, 7.0])]
    # Execute
    out = aggregate("median", updates, zeros_like(updates[0]))
    # Assert: sorted (1, 2, 5) -> 2; sorted (-4, 0, 7) -> 0.
    assert torch.equal(out[A], torch.tensor([2.0, 0.0]))


def test_median_even_k_averages_the_two_middle_values():
    # Prepare: K = 4; coordinate 0 holds 1, 2, 10, 4 -> sorted (1, 2, 4, 10).
    updates = [single("c1", [1.0]), single("c2", [2.0]), single("c3", [10.0]), single("c4", [4.0])]
    # Execute
    out = aggregate("median", updates, zeros_like(updates[0]))
    # Assert: (2 + 4) / 2 = 3, where torch.median would return the lower middle value, 2.
    assert torch.equal(out[A], torch.tensor([3.0]))
    assert torch.median(torch.tensor([1.0, 2.0, 10.0, 4.0])) == 2.0


def test_trimmed_mean_k5_cuts_one_value_from_each_end():
    # Prepare: K = 5, trim 0.2 -> floor(0.2 * 5) = 1 value cut at each end of each coordinate.
    values = [[10.0, 0.0], [1.0, 1.0], [2.0, 100.0], [6.0, 2.0], [-50.0, 6.0]]
    updates = [single(f"c{i}", v) for i, v in enumerate(values)]
    # Execute
    out = aggregate("trimmed_mean", updates, zeros_like(updates[0]), StrategyParams(trim_fraction=0.2))
    # Assert: coordinate 0 sorted (-50, 1, 2, 6, 10) -> (1 + 2 + 6) / 3 = 3 (the median would be 2,
    #         the mean -6.2); coordinate 1 sorted (0, 1, 2, 6, 100) -> (1 + 2 + 6) / 3 = 3.
    assert torch.equal(out[A], torch.tensor([3.0, 3.0]))


def test_trimmed_mean_that_cuts_nothing_is_the_mean():
    # K = 4, trim 0.2 -> floor(0.8) = 0: nothing cut, (1 + 2 + 3 + 10) / 4 = 4.
    updates = [single(f"c{i}", [v]) for i, v in enumerate([1.0, 2.0, 3.0, 10.0])]
    out = aggregate("trimmed_mean", updates, zeros_like(updates[0]), StrategyParams(trim_fraction=0.2))
    assert torch.equal(out[A], torch.tensor([4.0]))


def test_median_keeps_dtype():
    updates = [Update(f"c{i}", {A: torch.full((2, 3), float(i), dtype=torch.bfloat16)}, 1, 1) for i in range(3)]
    out = aggregate("median", updates, updates[0].adapter)
    assert out[A].dtype == torch.bfloat16 and torch.equal(out[A], torch.ones(2, 3, dtype=torch.bfloat16))


# ---- exact -------------------------------------------------------------------------------------

def test_exact_hand_computed_rank_one_mean_that_fedavg_misses():
    # Prepare: r = 1, K = 2. B_1 A_1 = [1;0][1 0] = [[1, 0], [0, 0]];
    #          B_2 A_2 = [-1;0][-1 2] = [[1, -2], [0, 0]]. Mean product = [[1, -1], [0, 0]] (rank 1 <= r).
    u1 = update("c1", [[1.0, 0.0]], [[1.0], [0.0]])
    u2 = update("c2", [[-1.0, 2.0]], [[-1.0], [0.0]])
    # Execute
    exact = aggregate("exact", [u1, u2], zeros_like(u1))
    naive = aggregate("fedavg", [u1, u2], zeros_like(u1))
    # Assert: B'A' is the mean product; fedavg's mean(B) = [0; 0] loses it entirely.
    assert torch.allclose(product(exact), torch.tensor([[1.0, -1.0], [0.0, 0.0]], dtype=torch.float64), atol=1e-6)
    assert torch.equal(product(naive), torch.zeros(2, 2, dtype=torch.float64))
    # Balanced factors: ||B'|| = ||A'|| = sqrt(sigma) = sqrt(sqrt(2)).
    assert torch.allclose(exact[B].norm(), torch.tensor(2.0 ** 0.25))
    assert torch.allclose(exact[A].norm(), exact[B].norm())


def test_exact_hand_computed_truncation_keeps_the_largest_direction():
    # Prepare: r = 1. B_1 A_1 = [1;0][1 0] = diag(1, 0); B_2 A_2 = [0;2][0 1] = diag(0, 2).
    # Mean product diag(0.5, 1) has rank 2 > r; its best rank-1 approximation is diag(0, 1).
    u1 = update("c1", [[1.0, 0.0]], [[1.0], [0.0]])
    u2 = update("c2", [[0.0, 1.0]], [[0.0], [2.0]])
    # Execute
    out = aggregate("exact", [u1, u2], zeros_like(u1))
    # Assert: B' = +-[0; 1], A' = +-[0 1] (sqrt(1) on each side).
    assert torch.allclose(product(out), torch.tensor([[0.0, 0.0], [0.0, 1.0]], dtype=torch.float64), atol=1e-6)
    assert torch.allclose(out[B].abs(), torch.tensor([[0.0], [1.0]]), atol=1e-6)
    assert torch.allclose(out[A].abs(), torch.tensor([[0.0, 1.0]]), atol=1e-6)


def random_updates(k: int, r: int, out_dim: int, in_dim: int, seed: int, dtype=torch.float32) -> list[Update]:
    g = torch.Generator().manual_seed(seed)
    return [Update(f"c{i}", {A: torch.randn(r, in_dim, generator=g).to(dtype),
                             B: torch.randn(out_dim, r, generator=g).to(dtype)}, 1, 1) for i in range(k)]


def mean_product(updates: list[Update]) -> torch.Tensor:
    return sum(u.adapter[B].double() @ u.adapter[A].double() for u in updates) / len(updates)


def test_exact_equals_mean_product_when_its_rank_is_at_most_r():
    # Prepare: K = 3 clients sharing one A (r = 2): mean product = mean(B) A has rank <= 2 = r.
    ups = random_updates(3, 2, 6, 5, seed=1)
    shared_a = ups[0].adapter[A]
    ups = [Update(u.client_id, {A: shared_a, B: u.adapter[B]}, 1, 1) for u in ups]
    # Execute
    out = aggregate("exact", ups, ups[0].adapter)
    # Assert
    assert torch.allclose(product(out), mean_product(ups), atol=1e-5)


def test_exact_is_the_truncated_svd_of_the_mean_product_with_shapes_and_dtype():
    # Prepare: K = 4, r = 2, out 6, in 5: the mean of 4 random rank-2 products has rank 5 > r.
    ups = random_updates(4, 2, 6, 5, seed=2)
    target = mean_product(ups)
    u, s, vh = torch.linalg.svd(target)
    assert int((s > 1e-9).sum()) == 5
    best_rank_2 = u[:, :2] @ torch.diag(s[:2]) @ vh[:2]
    # Execute
    out = aggregate("exact", ups, ups[0].adapter)
    # Assert
    assert out[A].shape == (2, 5) and out[B].shape == (6, 2)
    assert out[A].dtype == torch.float32 and out[B].dtype == torch.float32
    assert torch.allclose(product(out), best_rank_2, atol=1e-5)
    assert not torch.allclose(product(out), target, atol=1e-2)


def test_exact_with_one_client_reproduces_its_product_and_keeps_bf16():
    ups = random_updates(1, 3, 4, 7, seed=3, dtype=torch.bfloat16)
    out = aggregate("exact", ups, ups[0].adapter)
    assert out[A].dtype == torch.bfloat16 and out[B].dtype == torch.bfloat16
    assert torch.allclose(product(out), mean_product(ups), rtol=0.05, atol=0.05)


def test_exact_with_all_b_zero_gives_fedavg_and_averages_unpaired_tensors():
    # Round 0: B = 0 everywhere, so the mean product is 0. Zeroing A too would leave LoRA with no
    # gradient, so A' keeps the mean A rows: A' = ([1 2] + [3 4]) / 2 = [2 3], B' = 0.
    u1 = Update("c1", {A: torch.tensor([[1.0, 2.0]]), B: torch.zeros(2, 1), "m.bias": torch.tensor([1.0])}, 1, 1)
    u2 = Update("c2", {A: torch.tensor([[3.0, 4.0]]), B: torch.zeros(2, 1), "m.bias": torch.tensor([5.0])}, 1, 1)
    out = aggregate("exact", [u1, u2], u1.adapter)
    assert torch.equal(out[A], torch.tensor([[2.0, 3.0]]))
    assert torch.equal(out[B], torch.zeros(2, 1))
    assert torch.equal(out["m.bias"], torch.tensor([3.0]))  # not in an A/B pair: (1 + 5) / 2


def test_exact_pairs_named_adapter_keys():
    a, b = "m.lora_A.default.weight", "m.lora_B.default.weight"
    u1 = Update("c1", {a: torch.tensor([[1.0, 0.0]]), b: torch.tensor([[1.0], [0.0]])}, 1, 1)
    u2 = Update("c2", {a: torch.tensor([[-1.0, 2.0]]), b: torch.tensor([[-1.0], [0.0]])}, 1, 1)
    out = aggregate("exact", [u1, u2], u1.adapter)
    # Same pair as the hand-computed case above: mean product [[1, -1], [0, 0]].
    expected = torch.tensor([[1.0, -1.0], [0.0, 0.0]], dtype=torch.float64)
    assert torch.allclose(out[b].double() @ out[a].double(), expected, atol=1e-6)


# ---- clipping and noise ----------------------------------------------------------------------

def test_clipping_scales_a_norm_10_delta_down_to_1():
    # Prepare: phi_t = A [1 1], B [1; 1]. Client 1's delta is A [6 0], B [0; 8]: norm sqrt(36 + 64) = 10.
    # Client 2's delta is A [0.3 0], B [0; 0.4]: norm 0.5 < 1, left alone.
    previous = {A: torch.tensor([[1.0, 1.0]]), B: torch.tensor([[1.0], [1.0]])}
    u1 = update("c1", [[7.0, 1.0]], [[1.0], [9.0]])
    u2 = update("c2", [[1.3, 1.0]], [[1.0], [1.4]])
    # Execute
    out = aggregate("fedavg", [u1, u2], previous, StrategyParams(clip_norm=1.0))
    # Assert: client 1 becomes phi_t + delta / 10 = A [1.6 1], B [1; 1.8];
    #         mean A = ([1.6 1] + [1.3 1]) / 2 = [1.45 1], mean B = ([1; 1.8] + [1; 1.4]) / 2 = [1; 1.6].
    assert torch.allclose(out[A], torch.tensor([[1.45, 1.0]]), atol=1e-6)
    assert torch.allclose(out[B], torch.tensor([[1.0], [1.6]]), atol=1e-6)


def test_noise_has_the_calibrated_std_and_is_reproducible_per_round():
    # Prepare: K = 4 clients that did not move, so the aggregate is phi_t + noise only;
    # std = noise_multiplier * clip_norm / K = 2 * 1 / 4 = 0.5, over 20,000 coordinates.
    previous = {A: torch.zeros(100, 200)}
    updates = [Update(f"c{i}", previous, 1, 1) for i in range(4)]
    params = StrategyParams(clip_norm=1.0, noise_multiplier=2.0, seed=7)
    # Execute
    first = aggregate("fedavg", updates, previous, params, round_=3)[A]
    again = aggregate("fedavg", updates, previous, params, round_=3)[A]
    other_round = aggregate("fedavg", updates, previous, params, round_=4)[A]
    other_seed = aggregate("fedavg", updates, previous, StrategyParams(clip_norm=1.0, noise_multiplier=2.0, seed=8),
                           round_=3)[A]
    # Assert: over 2e4 normals the sample std has a standard error of 0.5 / sqrt(4e4) = 0.0025 and the
    # mean one of 0.5 / sqrt(2e4) = 0.0035; allow 4 of them.
    assert abs(first.std().item() - 0.5) < 0.01 and abs(first.mean().item()) < 0.015
    assert torch.equal(first, again)
    assert not torch.allclose(first, other_round) and not torch.allclose(first, other_seed)


# ---- a client that scales its update by 100 -----------------------------------------------------

def poisoned_round() -> tuple[list[Update], dict]:
    # Four honest clients around A [1 2], B [3; 4]; the fifth sends 100 x the honest [1 2], [3; 4].
    honest = [([[0.9, 2.1]], [[3.1], [3.9]]), ([[1.0, 2.0]], [[3.0], [4.0]]),
              ([[1.1, 1.9]], [[2.9], [4.1]]), ([[1.0, 2.0]], [[3.0], [4.0]])]
    updates = [update(f"h{i}", a, b) for i, (a, b) in enumerate(honest)]
    updates.append(update("attacker", [[100.0, 200.0]], [[300.0], [400.0]]))
    previous = {A: torch.tensor([[1.0, 2.0]]), B: torch.tensor([[3.0], [4.0]])}
    return updates, previous


@pytest.mark.parametrize("strategy, params, tolerance", [
    # median: coordinate 0 sorted (0.9, 1, 1, 1.1, 100) -> 1 exactly; likewise every coordinate.
    ("median", StrategyParams(), 1e-6),
    # trimmed mean: drop 0.9 and 100 -> (1 + 1 + 1.1) / 3 = 1.033; every coordinate within 0.05.
    ("trimmed_mean", StrategyParams(trim_fraction=0.2), 0.05),
    # clipping to 0.2: the attacker's delta (norm ~548) shrinks to norm 0.2, adding at most 0.2 / 5 = 0.04.
    ("fedavg", StrategyParams(clip_norm=0.2), 0.05),
])
def test_a_client_scaling_its_update_by_100_is_neutralised(strategy, params, tolerance):
    # Prepare
    updates, previous = poisoned_round()
    honest_mean = {A: torch.tensor([[1.0, 2.0]]), B: torch.tensor([[3.0], [4.0]])}
    # Execute
    robust = aggregate(strategy, updates, previous, params)
    naive = aggregate("fedavg", updates, previous)
    # Assert: fedavg is pulled to (0.9 + 1 + 1.1 + 1 + 100) / 5 = 20.8 on coordinate 0.
    assert torch.allclose(naive[A], torch.tensor([[20.8, 41.6]]), atol=1e-4)
    for name in (A, B):
        assert (robust[name] - honest_mean[name]).abs().max() < tolerance


# ---- lazy views ---------------------------------------------------------------------------------

@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_lazy_adapter_files_give_the_same_result_as_in_memory_adapters(tmp_path, strategy):
    # Prepare: each adapter written as safetensors bytes and read back through AdapterFile views.
    ups = random_updates(4, 2, 6, 5, seed=4)
    previous = {A: torch.zeros(2, 5), B: torch.zeros(6, 2)}
    (tmp_path / "prev.safetensors").write_bytes(encode(previous))
    lazy = []
    for u in ups:
        (tmp_path / f"{u.client_id}.safetensors").write_bytes(encode(u.adapter))
        lazy.append(Update(u.client_id, AdapterFile(tmp_path / f"{u.client_id}.safetensors"), 1, 1))
    products = BY_NAME[strategy].mixed and not BY_NAME[strategy].linear  # these refuse clipping and noise
    params = StrategyParams() if products else StrategyParams(clip_norm=3.0, noise_multiplier=0.1)
    # Execute
    from_files = aggregate(strategy, lazy, AdapterFile(tmp_path / "prev.safetensors"), params, round_=1)
    in_memory = aggregate(strategy, ups, previous, params, round_=1)
    # Assert
    assert list(from_files) == list(in_memory)
    assert all(torch.equal(from_files[n], in_memory[n]) for n in in_memory)


# ---- validation -----------------------------------------------------------------------------------

@pytest.mark.parametrize("strategy, params, message", [
    ("fedmean", StrategyParams(), "use one of fedavg, weighted, exact, hlora, flexlora, zero-pad, median, trimmed_mean"),
    ("trimmed_mean", StrategyParams(trim_fraction=0.5), r"trim_fraction 0.5 is outside \[0, 0.5\)"),
    ("trimmed_mean", StrategyParams(trim_fraction=-0.1), "trim_fraction -0.1"),
    ("fedavg", StrategyParams(clip_norm=-1.0), "clip_norm must be a finite number >= 0"),
    ("fedavg", StrategyParams(clip_norm=float("nan")), "clip_norm must be a finite number >= 0"),
    ("fedavg", StrategyParams(clip_norm=1.0, noise_multiplier=-1.0), "noise_multiplier must be"),
    ("fedavg", StrategyParams(noise_multiplier=1.0), "noise_multiplier > 0 needs clip_norm > 0"),
])
def test_validate_params_says_what_to_fix(strategy, params, message):
    with pytest.raises(ValueError, match=message):
        validate_params(strategy, params)
    with pytest.raises(ValueError, match=message):
        aggregate(strategy, [single("c1", [1.0])], {A: torch.zeros(1)}, params)


def test_validate_params_accepts_the_defaults_and_aggregate_refuses_an_empty_round():
    for name in STRATEGIES:
        validate_params(name, StrategyParams())
    validate_params("fedavg", StrategyParams(clip_norm=1.0, noise_multiplier=1.0))
    with pytest.raises(ValueError, match="no updates"):
        aggregate("fedavg", [], {A: torch.zeros(1)})
