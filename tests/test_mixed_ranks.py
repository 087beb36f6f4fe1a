"""Mixed LoRA ranks: the strategies' arithmetic (hlora exact against the dense truncated SVD, flexlora,
zero-pad), the clients' refactoring to their own rank, and the schema checks (fedse.model.ranks)."""

import io
import json

import pytest
import torch

from fedse.privacy import accounting
from fedse.model import adapter as ad
from fedse.model import ranks
from fedse.model.adapter import AdapterError, Schema
from services.aggregator.strategies import StrategyParams, Update, aggregate, validate_params

A, B = "base_model.model.m.lora_A.weight", "base_model.model.m.lora_B.weight"
A2, B2 = "base_model.model.n.lora_A.weight", "base_model.model.n.lora_B.weight"
OUT, IN = 24, 20


def client(r, alpha, gen, shapes=((A, B, OUT, IN), (A2, B2, 12, 16))):
    adapter = {}
    for a, b, out, inp in shapes:
        adapter[a] = torch.randn(r, inp, generator=gen, dtype=torch.float64)
        adapter[b] = torch.randn(out, r, generator=gen, dtype=torch.float64)
    return adapter, alpha / r


def previous(rank, gen):
    return {A: torch.randn(rank, IN, generator=gen, dtype=torch.float64), B: torch.zeros(OUT, rank, dtype=torch.float64),
            A2: torch.randn(rank, 16, generator=gen, dtype=torch.float64), B2: torch.zeros(12, rank, dtype=torch.float64)}


def dense(updates, weights, a, b):
    total = sum(weights)
    return sum(w / total * u.scaling * (u.adapter[b] @ u.adapter[a]) for u, w in zip(updates, weights))


def truncated_svd(matrix, r):
    u, s, vh = torch.linalg.svd(matrix, full_matrices=False)
    return (u[:, :r] * s[:r]) @ vh[:r]


def relative(x, y):
    return float((x - y).norm() / y.norm())


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_hlora_is_the_truncated_svd_of_the_dense_scaled_sum_for_ranks_2_4_8_16_mixed(seed):
    gen = torch.Generator().manual_seed(seed)
    rank, out_scaling = 16, 0.75
    updates = []
    for k, (r, alpha) in enumerate([(2, 4), (4, 16), (8, 8), (16, 32)]):
        adapter, s = client(r, alpha, gen)
        updates.append(Update(f"c{k}", adapter, num_examples=k + 1, num_successes=0, scaling=s))
    prev = previous(rank, gen)
    result = aggregate("hlora", updates, prev, out_scaling=out_scaling)
    for a, b in ((A, B), (A2, B2)):
        assert result[a].shape == (rank, prev[a].shape[1]) and result[b].shape == (prev[b].shape[0], rank)
        want = truncated_svd(dense(updates, [1.0] * 4, a, b), rank)
        assert relative(out_scaling * result[b] @ result[a], want) < 1e-5
    flex = aggregate("flexlora", updates, prev, out_scaling=out_scaling)  # weighted by examples 1..4
    want = truncated_svd(dense(updates, [1.0, 2.0, 3.0, 4.0], A, B), rank)
    assert relative(out_scaling * flex[B] @ flex[A], want) < 1e-5
    assert relative(out_scaling * flex[B] @ flex[A], out_scaling * result[B] @ result[A]) > 1e-3  # not hlora's


def test_flexlora_weighs_by_examples_and_keeps_the_largest_components_of_the_scaled_sum():
    # x: rank 1, scaling 1, 1 example; y: rank 2, scaling 0.5, 3 examples. p = (1/4, 3/4), so
    # dW = 1/4 * 1 * 2 e1e1^T + 3/4 * 0.5 * (3 e2e2^T + 1 e3e3^T) = diag(0.5, 1.125, 0.375); at rank 2 the
    # 0.375 goes, and with s_R = 0.5, B'A' = diag(1, 2.25, 0): B' = U sqrt(S), A' = sqrt(S) V^T.
    x = {A: torch.tensor([[1.0, 0, 0]]), B: torch.tensor([[2.0], [0], [0]])}
    y = {A: torch.tensor([[0.0, 1, 0], [0, 0, 1]]), B: torch.tensor([[0.0, 0], [3, 0], [0, 1]])}
    prev = {A: torch.zeros(2, 3), B: torch.zeros(3, 2)}
    got = aggregate("flexlora", [Update("x", x, 1, 0, scaling=1.0), Update("y", y, 3, 0, scaling=0.5)], prev,
                    out_scaling=0.5)
    assert torch.allclose(got[B] @ got[A], torch.diag(torch.tensor([1.0, 2.25, 0])), atol=1e-6)
    assert torch.allclose(got[B].abs(), torch.tensor([[0.0, 1], [1.5, 0], [0, 0]]), atol=1e-6)
    assert torch.allclose(got[A].abs(), torch.tensor([[0.0, 1.5, 0], [1, 0, 0]]), atol=1e-6)


def dense_flexlora(updates, rank, out_scaling, a, b):
    """What flexlora computed before it worked from the factors: the dense sum, a full SVD, cut to rank."""
    weights = [float(u.num_examples) for u in updates]
    delta = dense(updates, weights, a, b)
    u, s, vh = torch.linalg.svd(delta, full_matrices=False)
    return ranks.svd_factors(u, s, vh, rank, out_scaling, max(delta.shape))


@pytest.mark.parametrize("seed, client_ranks, rank, examples, out_scaling", [
    (0, (2, 4, 8, 16), 16, (1, 2, 3, 4), 0.75),
    (1, (16, 1, 8), 16, (100, 1, 7), 1.0),
    (2, (2, 4), 8, (5, 2), 2.0),  # sum of ranks 6 < 8: two components left dead
    (3, (4, 4, 4, 4, 4), 4, (3, 0, 9, 1, 1), 0.5),  # one rank, a client of no examples
])
def test_flexlora_from_the_factors_is_the_dense_svd_it_replaces_and_never_decomposes_an_out_by_in_matrix(
        monkeypatch, seed, client_ranks, rank, examples, out_scaling):
    gen = torch.Generator().manual_seed(seed)
    shapes = ((A, B, 40, 36), (A2, B2, 12, 16))  # m wider than every sum of ranks; n narrower than some
    updates = []
    for k, (r, n) in enumerate(zip(client_ranks, examples)):
        adapter, s = client(r, 2 * r + k, gen, shapes)
        updates.append(Update(f"c{k}", adapter, num_examples=n, num_successes=0, scaling=s))
    prev = {**client(rank, rank, gen, shapes)[0], B: torch.zeros(40, rank, dtype=torch.float64),
            B2: torch.zeros(12, rank, dtype=torch.float64)}
    want = {a: dense_flexlora(updates, rank, out_scaling, a, b) for a, b in ((A, B), (A2, B2))}
    decomposed = []
    svd = torch.linalg.svd
    monkeypatch.setattr(torch.linalg, "svd", lambda m, **kw: decomposed.append(tuple(m.shape)) or svd(m, **kw))
    got = aggregate("flexlora", updates, prev, out_scaling=out_scaling)
    monkeypatch.undo()
    assert decomposed and max(max(shape) for shape in decomposed) <= sum(client_ranks)
    for a, b in ((A, B), (A2, B2)):
        b_old, a_old, live = want[a]
        product, old = got[b] @ got[a], b_old @ a_old
        assert relative(product, old) < 1e-12
        assert torch.allclose(torch.linalg.svdvals(product)[:rank], torch.linalg.svdvals(old)[:rank], atol=1e-12)
        assert torch.allclose(got[a][~live], prev[a][~live]) and not got[b][:, ~live].any()
        assert int(live.sum()) == min(rank, sum(client_ranks), *prev[b].shape[:1], *prev[a].shape[1:])


def test_each_client_refactors_the_global_adapter_to_the_truncated_svd_at_its_own_rank_and_scaling():
    gen = torch.Generator().manual_seed(5)
    updates = [Update(f"c{r}", client(r, 2 * r, gen)[0], 1, 0, scaling=2.0) for r in (4, 8, 16)]
    prev = previous(16, gen)
    glob = aggregate("hlora", updates, prev)
    full = dense(updates, [1.0] * 3, A, B)
    for r, alpha in ((4, 8), (8, 32), (16, 16)):
        own = ranks.refactored(glob, r, alpha / r)
        assert own[A].shape == (r, IN) and own[B].shape == (OUT, r)
        assert relative(alpha / r * own[B] @ own[A], truncated_svd(full, r)) < 1e-5


def test_a_dead_component_keeps_a_row_of_a_so_that_it_can_still_learn():
    gen = torch.Generator().manual_seed(1)
    prev = previous(8, gen)
    fresh = [Update("a", {A: torch.randn(4, IN, dtype=torch.float64), B: torch.zeros(OUT, 4, dtype=torch.float64),
                          A2: torch.randn(4, 16, dtype=torch.float64), B2: torch.zeros(12, 4, dtype=torch.float64)},
                    1, 0, scaling=2.0)]
    glob = aggregate("hlora", fresh, prev)  # nothing trained: the product is 0
    assert torch.equal(glob[A], prev[A]) and not glob[B].any()
    own = ranks.refactored(glob, 4, 2.0)
    assert torch.equal(own[A], prev[A][:4]) and not own[B].any()


def test_zero_pad_averages_the_padded_factors_with_b_scaled_and_truncates_back():
    a1, b1 = torch.ones(2, 3), torch.full((4, 2), 2.0)  # rank 2, scaling 1
    a2, b2 = torch.full((4, 3), 3.0), torch.full((4, 4), 4.0)  # rank 4, scaling 0.5
    prev = {A: torch.zeros(4, 3), B: torch.zeros(4, 4)}
    result = aggregate("zero-pad", [Update("x", {A: a1, B: b1}, 1, 0, scaling=1.0),
                                    Update("y", {A: a2, B: b2}, 1, 0, scaling=0.5)], prev, out_scaling=0.5)
    assert torch.equal(result[A][:2], torch.full((2, 3), 2.0)) and torch.equal(result[A][2:], torch.full((2, 3), 1.5))
    # B of x scaled by 1 / 0.5 = 2 to 4.0, padded with zeros; y's as it is
    assert torch.equal(result[B][:, :2], torch.full((4, 2), 4.0)) and torch.equal(result[B][:, 2:], torch.full((4, 2), 2.0))
    back = ranks.truncated(result, 2, 1.0 / 0.5)
    assert torch.equal(back[A], result[A][:2]) and torch.equal(back[B], result[B][:, :2] / 2)
    padded = ranks.padded({A: a1, B: b1}, 4, 2.0)
    assert torch.equal(0.5 * padded[B] @ padded[A], 1.0 * b1 @ a1)  # the padded product is the client's update


def test_element_wise_strategies_refuse_mixed_ranks_and_products_refuse_clipping():
    prev = {A: torch.zeros(4, 3), B: torch.zeros(4, 4)}
    mixed = [Update("x", {A: torch.ones(2, 3), B: torch.ones(4, 2)}, 1, 0),
             Update("y", {A: torch.ones(4, 3), B: torch.ones(4, 4)}, 1, 0)]
    with pytest.raises(ValueError, match="hlora, flexlora or zero-pad"):
        aggregate("fedavg", mixed, prev)
    for strategy in ("hlora", "flexlora"):
        with pytest.raises(ValueError, match="zero-pad"):
            validate_params(strategy, StrategyParams(clip_norm=1.0))
    validate_params("zero-pad", StrategyParams(clip_norm=1.0, noise_multiplier=1.0))


def schema(r, alpha=None, **config):
    tensors = {A: torch.zeros(r, IN), B: torch.zeros(OUT, r), "other.bias": torch.zeros(3)}
    return Schema.of(tensors, json.dumps({"r": r, "lora_alpha": alpha or 2 * r, "peft_type": "LORA", **config}))


def test_a_clients_schema_fits_the_run_at_any_rank_up_to_the_maximum_and_says_what_differs():
    run = ranks.at_rank(schema(8), 16, 16)
    assert run.by_name()[A].shape == (16, IN) and json.loads(run.adapter_config_json)["r"] == 16
    assert ranks.scaling(run.adapter_config_json) == 1.0
    assert ranks.check_fits(run, schema(4, 32), 16) == 4 and ranks.scaling(schema(4, 32).adapter_config_json) == 8.0
    assert ranks.scaling(schema(4, 8, use_rslora=True).adapter_config_json) == 4.0
    with pytest.raises(AdapterError, match="above the run's maximum of 16"):
        ranks.check_fits(run, schema(32), 16)
    with pytest.raises(AdapterError, match="says r=8 but the LoRA factors have rank 4"):
        ranks.check_fits(run, Schema(schema(4).tensors, json.dumps({"r": 8, "lora_alpha": 16})), 16)
    with pytest.raises(AdapterError, match="rank_pattern"):
        ranks.check_fits(run, schema(4, rank_pattern={"m": 2}), 16)
    other = Schema.of({A: torch.zeros(4, IN + 1), B: torch.zeros(OUT, 4), "other.bias": torch.zeros(3)},
                      json.dumps({"r": 4, "lora_alpha": 8}))
    with pytest.raises(AdapterError, match="shape"):
        ranks.check_fits(run, other, 16)


# ---- a real run: clients at ranks 4, 8 and 16 ------------------------------------------------------

@pytest.mark.slow
def test_a_run_with_clients_at_ranks_4_8_and_16_finishes_and_its_adapter_loads_in_stock_peft(tmp_path):
    from peft import PeftModel

    from apps.launcher import run
    from apps.planning import RunConfig
    from fedse.model.tinymodel import build_tiny_model

    cfg = RunConfig(envs="maze,wordle?vocab_size=30,babyai", strategy="hlora", lora_ranks="maze=4,babyai=16",
                    results=str(tmp_path), rounds=2, expert_demos=4, explore_tasks=2, eval_tasks=2, epochs=1)
    results = run(cfg, out=io.StringIO())
    for env, rank in (("maze", 4), ("wordle", 8), ("babyai", 16)):
        rows = results["envs"][env]
        assert len(rows) == 3 and all(r["upload_bytes"] > 0 for r in rows[:2]), env
        upload = ad.decode((tmp_path / "state" / "clients" / f"org-{env}" / "upload.safetensors").read_bytes())
        assert {t.shape[0] for n, t in upload.items() if ".lora_A." in n} == {rank}, env
    final = tmp_path / "state" / "aggregator" / "local" / "global" / "round_0002"
    config = json.loads((final / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"]) == (16, 16)
    glob = ad.decode((final / "adapter_model.safetensors").read_bytes())
    assert {t.shape[0] for n, t in glob.items() if ".lora_A." in n} == {16}
    assert any(t.abs().sum() > 0 for n, t in glob.items() if ".lora_B." in n)  # it learnt something
    model = PeftModel.from_pretrained(build_tiny_model()[0], str(final))  # stock peft, the exported directory
    loaded = {n: p for n, p in model.named_parameters() if "lora_B" in n}
    assert loaded and all(p.shape[1] == 16 for p in loaded.values())


@pytest.mark.slow
def test_secure_mixed_ranks_by_zero_padding_with_a_guardian_that_sizes_the_rank_and_spends_its_budget(tmp_path):
    from apps.launcher import run
    from apps.planning import RunConfig

    # org-wordle's guardian chooses its rank (--lora-r 0): the run's maximum, 8, fits this machine. Both
    # clients keep a privacy budget that one round's release fits and two do not, with the noise they add
    # themselves (so small that the mean can be checked): both decline round 1, which closes without them.
    z = 1e-5
    one, two = accounting.epsilons(z, 1, 1e-5)[1], accounting.epsilons(z, 2, 1e-5)[1]
    cfg = RunConfig(envs="maze,wordle?vocab_size=30", strategy="zero-pad", lora_ranks="maze=4", lora_r=0,
                    lora_alpha=16, max_lora_rank=8, guardian=True, privacy_epsilon=(one + two) / 2,
                    secure_aggregation=True, clip_norm=10.0, noise_multiplier=z, results=str(tmp_path), rounds=2,
                    expert_demos=4, explore_tasks=0, eval_tasks=2, epochs=1)
    results = run(cfg, out=io.StringIO())
    clients = tmp_path / "state" / "clients"
    uploads = [ad.decode((clients / f"org-{env}" / "upload.safetensors").read_bytes()) for env in ("maze", "wordle")]
    assert uploads[0][first_a(uploads[0])].shape[0] == 4 and uploads[1][first_a(uploads[1])].shape[0] == 8
    glob = tmp_path / "state" / "aggregator" / "local" / "global"
    phi1 = ad.decode((glob / "round_0001" / "adapter_model.safetensors").read_bytes())
    # The aggregator saw only masked vectors; what it published is the mean of the padded adapters
    # (both clients' scaling is 2, the run's 1: B doubled), to the noise's and fixed point's precision,
    # with components 5..8 zero: only org-wordle holds them, fewer than the threshold of 2, so no one
    # sends them (ranks.held_rank).
    padded = [ranks.zero_above(ranks.padded(u, 8, 2.0), 4) for u in uploads]
    want = {n: (padded[0][n] + padded[1][n]) / 2 for n in phi1}
    assert all(t[4:].abs().sum() == 0 for n, t in phi1.items() if ".lora_A." in n)
    assert max(float((phi1[n] - want[n]).abs().max()) for n in phi1) < 1e-3
    assert (glob / "round_0002" / "adapter_model.safetensors").read_bytes() == \
        (glob / "round_0001" / "adapter_model.safetensors").read_bytes()  # round 1: every client declined
    for env in ("maze", "wordle"):
        final = results["envs"][env][-1]
        assert final["rounds_declined"] == 1.0 and final["privacy_epsilon_spent"] == pytest.approx(one), env
    assert results["envs"]["wordle"][-1]["guardian_rank"] == 8.0
    assert results["envs"]["maze"][-1]["guardian_rank"] == 4.0  # pinned by --lora-ranks: the guardian keeps it


def first_a(adapter):
    return next(n for n in adapter if ".lora_A." in n)


# ---- the aggregator over real gRPC ----------------------------------------------------------------

def lora_state(r, alpha, seed):
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict

    from fedse.model.tinymodel import build_tiny_model

    pm = get_peft_model(build_tiny_model(seed=0)[0], LoraConfig(r=r, lora_alpha=alpha, target_modules=["q_proj"],
                                                                lora_dropout=0.0))
    gen = torch.Generator().manual_seed(seed)
    state = {k: v.detach().clone() + 0.1 * torch.randn(v.shape, generator=gen)
             for k, v in get_peft_model_state_dict(pm, save_embedding_layers=False).items()}
    return state, json.dumps(pm.peft_config["default"].to_dict(), default=list)


def test_the_aggregator_takes_each_clients_rank_refuses_what_does_not_fit_and_keeps_ranks_over_a_restart(tmp_path):
    import grpc

    from apps.cli import format_status
    from fedse.model.tinymodel import TINY_MODEL_NAME
    from fedse.v1 import federation_pb2 as fpb
    from services.client_agent.federation.link import FederationClient
    from support import aggregator_in_process

    small, small_config = lora_state(2, 8, seed=1)   # scaling 4
    large, large_config = lora_state(4, 4, seed=2)   # scaling 1
    with aggregator_in_process(tmp_path, strategy="hlora", max_lora_rank=4, rounds=2) as (agg, port, run_dir):
        target = f"127.0.0.1:{port}"
        a, b, c = (FederationClient(target, name) for name in ("org-a", "org-b", "org-c"))
        assert a.join("maze", TINY_MODEL_NAME, ad.Schema.of(small, small_config)).config.max_lora_rank == 4
        huge = lora_state(8, 8, seed=3)
        with pytest.raises(grpc.RpcError) as err:
            c.join("maze", TINY_MODEL_NAME, ad.Schema.of(*huge))
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "above the run's maximum of 4" in \
            err.value.details()
        b.join("wordle", TINY_MODEL_NAME, ad.Schema.of(large, large_config))
        g0 = ad.decode(a.download(0).data)
        assert {t.shape[0] for n, t in g0.items() if ".lora_A." in n} == {4}
        with pytest.raises(grpc.RpcError) as err:  # org-a joined at rank 2: a rank-4 upload is not its own
            a.upload(0, ad.encode(large), 1, 1)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "shape" in err.value.details()
        a.upload(0, ad.encode(small), 1, 1)
        run = fpb.RunStatus()
        run.CopyFrom(a.stub.GetRunStatus(fpb.RunStatusRequest(), timeout=10))
        assert "mixed LoRA ranks up to 4 (hlora): org-a r2, org-b r4" in format_status(run)
        b.upload(0, ad.encode(large), 1, 1)
        b.wait_until(lambda s: s.round == 1)
        g1 = ad.decode(b.download(1).data)
        config = json.loads(b.download(1).adapter_config_json)
        assert (config["r"], config["lora_alpha"]) == (4, 4)
        for name in g1:
            if ".lora_A." in name:
                bn = ranks.partner(name)
                want = truncated_svd((4 * small[bn] @ small[name] + large[bn] @ large[name]) / 2, 4)
                assert relative(g1[bn].double() @ g1[name].double(), want.double()) < 1e-4
    with aggregator_in_process(tmp_path, strategy="hlora", max_lora_rank=4, rounds=2) as (agg, port, run_dir):
        again = FederationClient(f"127.0.0.1:{port}", "org-a")
        status = again.stub.GetRunStatus(fpb.RunStatusRequest(), timeout=10)
        assert {cl.client_id: cl.lora_rank for cl in status.clients} == {"org-a": 2, "org-b": 4}
        with pytest.raises(grpc.RpcError) as err:  # org-a's round-1 upload must still be at its rank
            again.upload(1, ad.encode(large), 1, 1)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        again.close()
    for client in (a, b, c):
        client.close()


@pytest.mark.parametrize("settings, message", [
    (dict(strategy="fedavg", max_lora_rank=8), "cannot average element by element"),
    (dict(strategy="hlora"), "--max-lora-rank"),
    (dict(strategy="hlora", max_lora_rank=8, secure_aggregation=True), "zero-pad with mixed ranks"),
    (dict(strategy="flexlora", max_lora_rank=8, clip_norm=1.0), "use --strategy zero-pad"),
    (dict(strategy="zero-pad", max_lora_rank=8, mode="async"), "--mode async"),
])
def test_the_aggregator_refuses_mixed_rank_settings_that_cannot_work_at_start_up(settings, message):
    from fedse.config import ConfigError
    from services.aggregator.server import AggregatorConfig

    with pytest.raises(ConfigError, match=message):
        AggregatorConfig(**settings)


def test_a_rejoin_may_not_change_the_rank_or_alpha_of_an_accepted_upload_before_its_round_closes(tmp_path):
    import grpc

    from fedse.model.tinymodel import TINY_MODEL_NAME
    from services.client_agent.federation.link import FederationClient
    from support import aggregator_in_process

    trained, alpha8 = lora_state(2, 8, seed=1)  # scaling 4
    _, alpha4 = lora_state(2, 4, seed=1)  # the same rank, scaling 2
    large, large_config = lora_state(4, 4, seed=2)
    with aggregator_in_process(tmp_path, strategy="hlora", max_lora_rank=4, rounds=2) as (agg, port, run_dir):
        a, b = (FederationClient(f"127.0.0.1:{port}", name) for name in ("org-a", "org-b"))
        a.join("maze", TINY_MODEL_NAME, ad.Schema.of(trained, alpha8))
        b.join("wordle", TINY_MODEL_NAME, ad.Schema.of(large, large_config))
        a.upload(0, ad.encode(trained), 1, 1)  # accepted at scaling 4
        for changed in (ad.Schema.of(trained, alpha4), ad.Schema.of(*lora_state(4, 16, seed=1))):
            with pytest.raises(grpc.RpcError) as err:
                a.join("maze", TINY_MODEL_NAME, changed)
            assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "joined at LoRA rank 2, scaling 4 (lora_alpha / r), and its upload of round 0 is accepted" in \
                err.value.details() and "rejoin with --lora-r 2 and the --lora-alpha it had" in err.value.details()
        a.join("maze", TINY_MODEL_NAME, ad.Schema.of(trained, alpha8))  # the same settings: welcome
        b.upload(0, ad.encode(large), 1, 1)
        b.wait_until(lambda s: s.round == 1)
        g1 = ad.decode(b.download(1).data)  # org-a's upload aggregated at the scaling it was trained with
        for name in g1:
            if ".lora_A." in name:
                bn = ranks.partner(name)
                want = truncated_svd((4 * trained[bn] @ trained[name] + large[bn] @ large[name]) / 2, 4)
                assert relative(g1[bn].double() @ g1[name].double(), want.double()) < 1e-4
        a.join("maze", TINY_MODEL_NAME, ad.Schema.of(trained, alpha4))  # after the round closed: its new alpha
        a.close(), b.close()
