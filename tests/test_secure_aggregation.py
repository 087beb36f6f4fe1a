"""Secure aggregation over real gRPC with a real aggregator: the published mean equals plain FedAvg of
the clients' adapters, while the aggregator's files hold no client's adapter; dropouts before and after
the masked upload; an attempt below the threshold abandoned and retried; an aggregator restarted
mid-round; the settings that cannot work refused."""

from __future__ import annotations

import contextlib
import logging
import time

import grpc
import pytest
import torch

from fedse.model import adapter as ad
from fedse.privacy import secagg
from fedse.config import ConfigError
from fedse.v1 import federation_pb2 as fpb
from secure_party import Party, base_adapter, close_to, leaks
from services.aggregator import metrics
from services.aggregator.server import AggregatorConfig
from services.client_agent.federation.secure import Protection
from support import aggregator_in_process, free_ports


def settings(**over):
    return {"secure_aggregation": True, "rounds": 1, "min_clients": 2, "heartbeat_timeout_s": 1.5,
            "heartbeat_interval_s": 0.3, "secure_stage_timeout_s": 30.0, **over}


@contextlib.contextmanager
def federation(tmp_path, n, **over):
    """A secure aggregator waiting for `n` clients, and `n` joined parties (org-0...), which expect the
    dropout rate the aggregator is told (their least ring is then the aggregator's)."""
    with aggregator_in_process(tmp_path, **settings(start_clients=n, **over)) as (agg, port, run_dir):
        rate = over.get("secure_dropout_rate", 0.05)
        parties = [Party(f"127.0.0.1:{port}", f"org-{i}", seed=100 + i,
                         protection=Protection(min_colluders=0, dropout_rate=rate)).join() for i in range(n)]
        try:
            yield agg, port, run_dir, parties
        finally:
            for p in parties:
                p.close()


def finish(parties, threads, timeout=60.0):
    for t in threads:
        t.join(timeout)
    return [p.result for p in parties]


def mean_of(parties, weights=None):
    weights = weights or [1.0] * len(parties)
    total = sum(weights)
    return {k: sum(w * p.adapter[k].double() for w, p in zip(weights, parties)) / total for k in base_adapter()}


def published(party, round_=1) -> ad.Adapter:
    return ad.decode(party.fed.download(round_).data)


def assert_equals_mean(glob, want):
    for name, t in want.items():
        assert close_to(glob[name], t), (name, float((glob[name].double() - t).abs().max()))


def counter(c, *labels) -> float:
    return (c.labels(*labels) if labels else c)._value.get()


def test_the_secure_mean_is_fedavg_and_the_aggregator_keeps_no_adapter(tmp_path, caplog):
    caplog.set_level(logging.INFO)
    with federation(tmp_path, 5) as (agg, _, run_dir, parties):
        assert parties[0].config.secure_aggregation
        results = finish(parties, [p.start() for p in parties])
        assert results == [True] * 5
        glob = published(parties[0])
        assert_equals_mean(glob, mean_of(parties))
        files = [f for f in run_dir.rglob("*") if f.is_file()]
        assert not list(run_dir.glob("uploads/round_0000/*")), "masked uploads are deleted once unmasked"
        assert leaks(files, {p.client_id: p.adapter for p in parties}, base_adapter()) == []
        # The unmasked mean is published; no client's own adapter is anywhere.
        assert any(f.name == "adapter_model.safetensors" and "round_0001" in str(f) for f in files)
    log_text = "\n".join(f"{r.getMessage()} {getattr(r, 'fields', '')}" for r in caplog.records)
    for p in parties:
        for t in p.adapter.values():
            assert f"{float(t.reshape(-1)[0]):.6g}" not in log_text


def test_weighted_weighs_by_successes_inside_the_masked_vector(tmp_path):
    with federation(tmp_path, 3, strategy="weighted") as (_, _, _, parties):
        for p, s in zip(parties, (0, 1, 3)):
            p.successes = s
        assert finish(parties, [p.start() for p in parties]) == [True] * 3
        assert_equals_mean(published(parties[0]), mean_of(parties, [0.0, 1.0, 3.0]))


def test_weighted_with_no_success_anywhere_keeps_the_global_adapter(tmp_path):
    """The masked sum holds no plain mean to fall back on: with every weight 0 the weighted mean is
    undefined, and the round closes withheld, phi_1 = phi_0."""
    withheld = counter(metrics.SECURE_ROUNDS_WITHHELD)
    with federation(tmp_path, 3, strategy="weighted") as (_, _, _, parties):
        for p in parties:
            p.successes = 0
        assert finish(parties, [p.start() for p in parties]) == [True] * 3
        assert parties[0].fed.download(1).data == parties[0].fed.download(0).data
    assert counter(metrics.SECURE_ROUNDS_WITHHELD) == withheld + 1


def test_dropouts_before_and_after_the_masked_upload(tmp_path):
    """org-3 dies after its masked upload (its self mask is rebuilt; its upload counts), org-4 after
    sharing keys and before uploading (its pairwise masks are rebuilt and removed; it is left out)."""
    recovered = counter(metrics.SECURE_DROPOUTS_RECOVERED)
    with federation(tmp_path, 5) as (agg, _, run_dir, parties):
        parties[3].hold_at, parties[4].hold_at = "uploaded", "shared"
        threads = [p.start() for p in parties]
        # While the round waits for the silent org-4, the masked uploads on disk reveal nothing.
        deadline = time.time() + 30
        while len(list(run_dir.glob("uploads/round_0000/*.masked"))) < 4 and time.time() < deadline:
            time.sleep(0.05)
        masked = list(run_dir.glob("uploads/round_0000/*.masked"))
        assert len(masked) == 4
        assert leaks(masked, {p.client_id: p.adapter for p in parties}, base_adapter()) == []
        assert finish(parties[:3], threads[:3]) == [True] * 3
        assert_equals_mean(published(parties[0]), mean_of(parties[:4]))
    assert counter(metrics.SECURE_DROPOUTS_RECOVERED) == recovered + 1


def test_an_attempt_below_the_threshold_publishes_nothing_and_starts_again(tmp_path):
    aborted = counter(metrics.SECURE_ATTEMPTS_ABORTED, "uploading")
    with federation(tmp_path, 4, secure_threshold=3) as (agg, port, run_dir, parties):
        parties[2].hold_at = parties[3].hold_at = "shared"
        first = parties[0].fed.status().round_nonce
        threads = [p.start() for p in parties]
        deadline = time.time() + 30
        while counter(metrics.SECURE_ATTEMPTS_ABORTED, "uploading") == aborted and time.time() < deadline:
            time.sleep(0.05)
        assert counter(metrics.SECURE_ATTEMPTS_ABORTED, "uploading") == aborted + 1
        st = parties[0].fed.status()
        assert st.round == 0 and st.round_nonce != first and st.state == fpb.ROUND_STATE_OPEN
        assert not (run_dir / "global" / "round_0001").exists()
        assert not list(run_dir.glob("uploads/round_0000/*")), "the abandoned attempt's masked uploads are gone"
        # org-3 comes back (a restarted client, same id): the next attempt has three and finishes.
        back = Party(f"127.0.0.1:{port}", "org-3", seed=103).join()
        try:
            threads.append(back.start())
            assert finish([parties[0], parties[1], back], [threads[0], threads[1], threads[-1]]) == [True] * 3
            assert_equals_mean(published(back), mean_of([parties[0], parties[1], back]))
        finally:
            back.close()


def test_a_restarted_aggregator_redoes_the_round_s_secure_stages(tmp_path):
    (port,) = free_ports(1)
    over = settings(address=f"127.0.0.1:{port}", start_clients=3, heartbeat_timeout_s=4.0)
    with contextlib.ExitStack() as stack:
        agg, _, run_dir = stack.enter_context(aggregator_in_process(tmp_path, **over))
        parties = [Party(f"127.0.0.1:{port}", f"org-{i}", seed=100 + i).join() for i in range(3)]
        parties[2].hold_at = "shared"
        threads = [p.start() for p in parties]
        deadline = time.time() + 30
        while len(list(run_dir.glob("uploads/round_0000/*.masked"))) < 2 and time.time() < deadline:
            time.sleep(0.05)
        nonce = parties[0].fed.status().round_nonce
        stack.close()  # the aggregator dies with two masked uploads accepted
        with aggregator_in_process(tmp_path, **over) as (agg2, _, run_dir):
            assert not list(run_dir.glob("uploads/round_0000/*.masked")), "the lost attempt's uploads are dropped"
            assert finish(parties[:2], threads[:2]) == [True, True]
            assert parties[0].fed.status().round_nonce != nonce
            assert_equals_mean(published(parties[0]), mean_of(parties[:2]))
        for p in parties:
            p.close()


@pytest.mark.parametrize("strategy", ["median", "trimmed_mean", "exact"])
def test_strategies_that_need_each_client_s_values_are_refused(strategy):
    with pytest.raises(ConfigError, match=f"--strategy {strategy} cannot work with --secure-aggregation"):
        AggregatorConfig(secure_aggregation=True, strategy=strategy)


def test_noise_is_calibrated_for_fedavg_only():
    with pytest.raises(ConfigError, match="use --strategy fedavg"):
        AggregatorConfig(secure_aggregation=True, strategy="weighted", clip_norm=1.0, noise_multiplier=1.0)
    AggregatorConfig(secure_aggregation=True, clip_norm=1.0, noise_multiplier=1.0)


def test_clipping_and_distributed_noise_stay_around_the_clipped_mean(tmp_path):
    """Each client clips its update to clip_norm and adds noise of std z*C/sqrt(t) to every value: the
    published mean is the mean of the clipped adapters plus noise of std z*C/sqrt(t)*sqrt(3)/3 per value."""
    clip, z = 0.05, 0.5
    with federation(tmp_path, 3, clip_norm=clip, noise_multiplier=z) as (_, _, _, parties):
        assert parties[0].config.clip_norm == clip and parties[0].config.noise_multiplier == z
        assert finish(parties, [p.start() for p in parties]) == [True] * 3
        glob = published(parties[0])
    base = base_adapter()
    clipped = [secagg.clip_and_noise(p.adapter, base, clip, 0.0) for p in parties]
    want = {k: sum(c[k] for c in clipped) / 3 for k in base}
    assert torch.sqrt(sum(((want[k] - mean_of(parties)[k]) ** 2).sum() for k in base)) > 0.1  # clipping bit
    values = sum(t.numel() for t in base.values())
    noise = torch.cat([(glob[k].double() - want[k]).reshape(-1) for k in base])
    std = z * clip / 2 ** 0.5 * 3 ** 0.5 / 3  # t = 2 of 3
    assert 0.8 * std < float(noise.std()) < 1.2 * std, (float(noise.std()), std, values)


def test_a_plain_upload_to_a_secure_run_is_refused(tmp_path):
    with federation(tmp_path, 2) as (_, _, _, parties):
        fed = parties[0].fed
        st = fed.status()
        data = ad.encode(parties[0].adapter)
        with pytest.raises(grpc.RpcError) as err:
            fed.upload(0, data, 1, 1, round_nonce=st.round_nonce)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "masked vector" in err.value.details()


def test_neighbourhoods_are_a_random_harary_graph():
    ids = [f"org-{i:02d}" for i in range(11)]
    graph = secagg.neighbours(ids, b"run|nonce-1", 4)
    assert all(cid in near and len(near) == 5 for cid, near in graph.items())
    assert all(a in graph[b] for a in ids for b in graph[a])  # symmetric
    assert graph == secagg.neighbours(list(reversed(ids)), b"run|nonce-1", 4)  # every party draws the same
    assert graph != secagg.neighbours(ids, b"run|nonce-2", 4)  # each attempt its own
    assert set(secagg.neighbours(ids, b"c", 0)["org-00"]) == set(ids)
    assert set(secagg.neighbours(ids[:4], b"c", 4)["org-00"]) == set(ids[:4])


def test_a_sparse_neighbourhood_recovers_dropouts_before_and_after_the_upload(tmp_path):
    """Nine clients, four neighbours each (threshold 3 of 5): org-7 dies after its masked upload, org-8
    after sharing; the mean is over the eight uploads."""
    with federation(tmp_path, 9, secure_neighbours=4, secure_max_roster=9, secure_dropout_rate=0.01) as \
            (_, _, _, parties):
        assert parties[0].config.secure_neighbours == 4
        parties[7].hold_at, parties[8].hold_at = "uploaded", "shared"
        threads = [p.start() for p in parties]
        assert finish(parties[:7], threads[:7]) == [True] * 7
        assert_equals_mean(published(parties[0]), mean_of(parties[:8]))


def test_an_adapter_out_of_the_fixed_point_range_sits_the_round_out(tmp_path):
    """org-2's adapter holds 5000: it is refused before any stage (never clipped), and the others'
    round closes with their mean (advertisement waits --wait-after-min-s for it, as a round waits for
    an upload)."""
    with federation(tmp_path, 3, wait_after_min_s=1.0) as (_, _, _, parties):
        next(iter(parties[2].adapter.values()))[0, 0] = 5000.0
        threads = [p.start() for p in parties]
        results = finish(parties, threads)
        assert results[:2] == [True, True]
        assert isinstance(results[2], secagg.SecureError) and "within ±4096" in str(results[2])
        assert_equals_mean(published(parties[0]), mean_of(parties[:2]))


def test_with_a_selector_only_the_chosen_clients_take_part_and_their_mean_is_published(tmp_path):
    from services.client_agent.federation.link import NotSelected

    with federation(tmp_path, 4, selector="sample", clients_per_round=2) as (agg, _, run_dir, parties):
        chosen = set(parties[0].fed.status().selected)
        assert len(chosen) == 2
        threads = [p.start() for p in parties]
        results = finish(parties, threads)
        for p, result in zip(parties, results):
            if p.client_id in chosen:
                assert result is True
            else:  # told at once, before any stage: it takes no part in the attempt
                assert isinstance(result, NotSelected) and not p.steps
        assert_equals_mean(published(parties[0]), mean_of([p for p in parties if p.client_id in chosen]))
