"""Secure aggregation against an honest-but-curious aggregator: real secure rounds over real gRPC, with
the unmasked total captured where the aggregator computes it (secagg.unmasked_sum), to show what it
holds and nothing more.

- weighted: the total is exactly [sum w*x, sum w, count], made in the ring (equal to the predicted
  uint64 sum bit for bit), so neither the plain sum nor one client's adapter follows from it even
  where one client's weight differs; the weighted mean is the plain one within 2^-41;
- zero-pad with mixed ranks: no LoRA component is summed over fewer than the threshold of uploads
  (a client zeroes its components above r*, the aggregator abandons an attempt whose uploaders hold
  a component thinly, a client refuses to reveal for one); where every component is held by t or
  more, the secure mean is plain zero-pad's;
- masked uploads carry no weight or success count in their header.
"""

from __future__ import annotations

import contextlib
import json
import time

import grpc
import numpy as np
import pytest
import torch

from fedse.model import adapter as ad
from fedse.privacy import fixedpoint as fx
from fedse.privacy import masking
from fedse.model import ranks
from fedse.privacy import secagg
from fedse.security import signatures
from secure_party import Party, base_adapter
from services.aggregator import metrics
from services.aggregator.secure import SecureDesk
from services.aggregator.strategies import Update, aggregate
from support import aggregator_in_process


def settings(**over):
    return {"secure_aggregation": True, "rounds": 1, "min_clients": 2, "heartbeat_timeout_s": 1.5,
            "heartbeat_interval_s": 0.3, "secure_stage_timeout_s": 30.0, **over}


@contextlib.contextmanager
def captured(monkeypatch, agg):
    """The unmasked totals the aggregator computes (secagg.unmasked_sum's results), and the headers of
    the uploads it is sent (UploadHeader: client, counts, transport)."""
    totals, headers = [], []
    real_sum = secagg.unmasked_sum

    def recording_sum(*args, **kwargs):
        totals.append(real_sum(*args, **kwargs).copy())
        return totals[-1]

    real_begin = agg.federation.begin_upload

    def recording_begin(h):
        headers.append(h)
        return real_begin(h)

    monkeypatch.setattr(secagg, "unmasked_sum", recording_sum)
    monkeypatch.setattr(agg.federation, "begin_upload", recording_begin)
    yield totals, headers


def finish(parties, timeout=60.0):
    threads = [p.start() for p in parties]
    for t in threads:
        t.join(timeout)
    return [p.result for p in parties]


def doubles(adapter):
    return {k: v.double() for k, v in adapter.items()}


# ---- weighted -----------------------------------------------------------------------------------
def test_weighted_unmasks_only_the_weighted_sum_the_weights_and_the_count(tmp_path, monkeypatch):
    with aggregator_in_process(tmp_path, **settings(strategy="weighted", start_clients=3)) as (agg, port, _), \
            captured(monkeypatch, agg) as (totals, headers):
        parties = [Party(f"127.0.0.1:{port}", f"org-{i}", seed=300 + i).join() for i in range(3)]
        for p, s in zip(parties, (1, 1, 5)):  # org-2's weight differs from the others'
            p.successes = s
        try:
            assert finish(parties) == [True] * 3
            published = ad.decode(parties[0].fed.download(1).data)
        finally:
            for p in parties:
                p.close()
    layout = secagg.Layout.of(parties[0].schema, "weighted")
    weights = [1, 1, 5]
    adapters = [doubles(p.adapter) for p in parties]
    (total,) = totals
    # Exactly [sum w*enc(x), enc(sum w), enc(3)]: the ring sum of what each client encodes, bit for bit.
    assert total.shape == (layout.values + 2,)
    predicted = np.zeros(layout.length, dtype=np.uint64)
    for a, w in zip(adapters, weights):
        predicted = fx.add(predicted, layout.encode(a, w))
    assert np.array_equal(total, predicted)
    assert fx.decode_sum(total, 3)[-2:].tolist() == [7.0, 3.0]
    # Neither the plain sum nor one client's adapter follows from it: other adapters with the same
    # weighted sum (org-0 moved by 5d, org-2 by -d; d a whole number of fixed-point steps) but another
    # plain sum and another org-0 give the very same total.
    d = {k: torch.full(v.shape, 3 * 2.0 ** -20, dtype=torch.float64) for k, v in adapters[0].items()}
    other = [{k: v + 5 * d[k] for k, v in adapters[0].items()}, adapters[1],
             {k: v - d[k] for k, v in adapters[2].items()}]
    again = np.zeros(layout.length, dtype=np.uint64)
    for a, w in zip(other, weights):
        again = fx.add(again, layout.encode(a, w))
    assert np.array_equal(again, total)
    for name in adapters[0]:
        assert not torch.allclose(sum(a[name] for a in other), sum(a[name] for a in adapters), rtol=0, atol=1e-7)
    # The secure weighted mean is the plain one (float64, the same adapters) within 2^-41.
    plain = aggregate("weighted", [Update(p.client_id, a, 0, w) for p, a, w in zip(parties, adapters, weights)],
                      doubles(base_adapter()))
    secure = layout.decode_mean(total, 3)
    for name, want in plain.items():
        error = (secure[name] - want).abs()
        assert bool((error <= fx.MEAN_ERROR_BOUND + 2.0 ** -52 * want.abs()).all()), (name, float(error.max()))
        assert torch.equal(published[name], secure[name].to(published[name].dtype))
    # (c) The masked uploads' headers count nothing: the weight travels masked.
    assert sorted(h.client_id for h in headers) == ["org-0", "org-1", "org-2"]
    assert all((h.num_examples, h.num_successes, h.transport) == (0, 0, secagg.MASKED_DTYPE) for h in headers)


def test_the_ring_makes_the_weighted_terms_exactly():
    """w * enc(x) in Z_2^64 for w up to CLIP and |w x| up to CLIP: the sum of 1024 such terms decodes to
    the weighted sum within 1024 * w * 2^-41, with no float32 product on the way (the former layout's
    2.6e-9)."""
    rng = np.random.default_rng(7)
    x = rng.normal(0, 0.02, size=(fx.MAX_CLIENTS, 16)).astype(np.float32).astype(np.float64)
    w = rng.integers(0, 50, size=fx.MAX_CLIENTS)
    total = np.zeros(16, dtype=np.uint64)
    for xi, wi in zip(x, w):
        total = fx.add(total, fx.times(fx.encode(xi), int(wi)))
    exact = (w[:, None] * x).sum(axis=0) / w.sum()
    assert np.abs(fx.decode_sum(total, fx.MAX_CLIENTS) / w.sum() - exact).max() <= fx.MEAN_ERROR_BOUND + 1e-16
    at_clip = fx.times(fx.encode(np.full(4, fx.CLIP / 4096)), 4096)  # |w x| = CLIP, w = CLIP
    summed = np.zeros(4, dtype=np.uint64)
    for _ in range(fx.MAX_CLIENTS):
        summed = fx.add(summed, at_clip)
    assert (fx.decode_sum(summed, fx.MAX_CLIENTS) == fx.MAX_CLIENTS * fx.CLIP).all()  # no wrap
    for bad in (-1, 2.5, 4097, True):
        with pytest.raises(ValueError, match="whole number from 0 to 4096"):
            fx.times(fx.encode(np.zeros(1)), bad)
    layout = secagg.Layout.of(ad.Schema.of({"a": torch.zeros(2)}, "{}"), "weighted")
    with pytest.raises(secagg.SecureError, match="a times its weight 3000"):
        layout.check({"a": torch.tensor([0.1, 2.0])}, 3000)


# ---- zero-pad with mixed ranks ------------------------------------------------------------------
IN = OUT = 24


def lora_base(r: int) -> ad.Adapter:
    """phi_0 of a client of rank r: two LoRA pairs, A random, B zero."""
    g = torch.Generator().manual_seed(55)
    out = {f"base_model.model.layer{i}.lora_A.weight": torch.randn(r, IN, generator=g) * 0.05 for i in range(2)}
    out.update({f"base_model.model.layer{i}.lora_B.weight": torch.zeros(OUT, r) for i in range(2)})
    return out


def ranked(target: str, client_id: str, seed: int, r: int, **kw) -> Party:
    """A party of LoRA rank r and lora_alpha 2r (scaling 2; the run's is 1, so its B is doubled padded)."""
    base = lora_base(r)
    schema = ad.Schema.of(base, json.dumps({"peft_type": "LORA", "r": r, "lora_alpha": 2 * r}))
    return Party(target, client_id, seed, schema=schema, base=base, **kw)


def padded_of(p: Party, top: int = 8) -> ad.Adapter:
    return ranks.padded(doubles(p.adapter), top, 2.0)


def component(t: torch.Tensor, name: str, j: int) -> torch.Tensor:
    """Component j (0-based) of a LoRA factor: A's row j, B's column j."""
    return t[j] if ".lora_A." in name else t[:, j]


def assert_total(total: np.ndarray, parties: list[Party], cut: int) -> None:
    """The unmasked total of `parties`' padded adapters (rank 8) holds their sum in components 1..cut and
    exactly zero above: no client's values where fewer than the threshold hold them."""
    layout = secagg.Layout.of(ranks.run_schema(parties[0].schema, 8), "zero-pad")
    assert total.shape == (layout.values + 1,)
    values, at = fx.decode_sum(total, len(parties)), 0
    assert values[-1] == len(parties)
    pads = [padded_of(p) for p in parties]
    for name, shape in zip(layout.names, layout.shapes):
        size = int(np.prod(shape))
        summed = torch.from_numpy(values[at:at + size].reshape(shape))
        at += size
        for j in range(8):
            got = component(summed, name, j)
            if j >= cut:
                assert torch.equal(got, torch.zeros_like(got)), (name, j)
            else:
                want = sum(component(a[name], name, j) for a in pads)
                assert float((got - want).abs().max()) <= len(parties) * fx.MEAN_ERROR_BOUND, (name, j)


@pytest.mark.parametrize("rank_of, threshold, cut", [
    ((8, 4, 4), 2, 4),   # only org-0 holds components 5..8: it sends none of them
    ((8, 4, 4), 3, 4),
    ((8, 8, 4), 2, 8),   # components 5..8 held by two, the threshold: sent, and secure = plain zero-pad
])
def test_zero_pad_sums_no_component_held_by_fewer_than_the_threshold(tmp_path, monkeypatch, rank_of, threshold, cut):
    over = settings(strategy="zero-pad", max_lora_rank=8, start_clients=3, secure_threshold=threshold)
    with aggregator_in_process(tmp_path, **over) as (agg, port, _), captured(monkeypatch, agg) as (totals, headers):
        target = f"127.0.0.1:{port}"
        parties = [ranked(target, f"org-{i}", 400 + i, r).join() for i, r in enumerate(rank_of)]
        try:
            assert parties[0].config.max_lora_rank == 8
            st = parties[2].fed.status()
            keys = secagg.Participant("org-2", secagg.context("t", 0, st.round_nonce))
            with pytest.raises(grpc.RpcError) as err:  # a rank it did not join with (4) is refused
                parties[2].fed.advertise_keys(0, st.round_nonce, keys.sealing.public, keys.masking.public,
                                              keys.self_commitment, lora_rank=8)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "the LoRA rank this client joined with (4)" in err.value.details()
            assert finish(parties) == [True] * 3
            published = ad.decode(parties[0].fed.download(1).data)
        finally:
            for p in parties:
                p.close()
    (total,) = totals
    assert_total(total, parties, cut)  # above cut: held by fewer than t, zero in the total, not org-0's values
    if cut == 8:  # every component held by t or more: the secure mean is plain zero-pad's
        updates = [Update(p.client_id, doubles(p.adapter), 0, 0, scaling=2.0) for p in parties]
        plain = aggregate("zero-pad", updates, ranks.padded(doubles(lora_base(8)), 8, 1.0), out_scaling=1.0)
        for name, want in plain.items():
            assert float((published[name].double() - want).abs().max()) <= 1e-6 * float(want.abs().max()), name
    assert all((h.num_examples, h.num_successes) == (0, 0) for h in headers)


def test_an_attempt_whose_uploaders_hold_a_component_thinly_is_abandoned(tmp_path, monkeypatch):
    """Ranks 8, 8, 8, 4 at threshold 3: r* = 8. org-2 (rank 8) dies after sharing, so components 5..8
    would be summed over two uploads: the aggregator abandons the attempt before unmasking. The next,
    without org-2, has r* = 4 (the 3rd largest of 8, 8, 4): no one sends components 5..8."""
    aborted = metrics.SECURE_ATTEMPTS_ABORTED.labels("uploading")._value.get()
    over = settings(strategy="zero-pad", max_lora_rank=8, start_clients=4, secure_threshold=3)
    with aggregator_in_process(tmp_path, **over) as (agg, port, _), captured(monkeypatch, agg) as (totals, _h):
        target = f"127.0.0.1:{port}"
        parties = [ranked(target, f"org-{i}", 500 + i, r).join() for i, r in enumerate((8, 8, 8, 4))]
        parties[2].hold_at = "shared"
        try:
            threads = [p.start() for p in parties]
            for i in (0, 1, 3):
                threads[i].join(60)
            assert [parties[i].result for i in (0, 1, 3)] == [True] * 3
        finally:
            for p in parties:
                p.close()
    assert metrics.SECURE_ATTEMPTS_ABORTED.labels("uploading")._value.get() == aborted + 1
    (total,) = totals  # the abandoned attempt was never unmasked
    assert_total(total, [parties[i] for i in (0, 1, 3)], cut=4)


def test_a_client_refuses_to_reveal_where_its_components_are_held_by_fewer_than_the_threshold(tmp_path,
                                                                                                monkeypatch):
    """An aggregator that skips its own check (it unmasks whatever it gets): the rank-8 uploaders see that
    only two uploads hold their components 5..8, fewer than the threshold of 3, and reveal nothing."""
    monkeypatch.setattr(SecureDesk, "_thinly_held", lambda self, a: 0)
    over = settings(strategy="zero-pad", max_lora_rank=8, start_clients=4, secure_threshold=3,
                    secure_stage_timeout_s=5.0)
    with aggregator_in_process(tmp_path, **over) as (agg, port, _), captured(monkeypatch, agg) as (totals, _h):
        target = f"127.0.0.1:{port}"
        parties = [ranked(target, f"org-{i}", 600 + i, r).join() for i, r in enumerate((8, 8, 8, 4))]
        parties[2].hold_at = "shared"
        try:
            threads = [p.start() for p in parties]
            for i in (0, 1):
                threads[i].join(60)
            for i in (0, 1):
                result = parties[i].result
                assert isinstance(result, secagg.SecureError), result
                assert "2 uploads hold this client's LoRA component 8, fewer than the threshold of 3" in str(result)
                assert "unmasked" not in parties[i].steps
            time.sleep(0.5)
            assert totals == []  # nothing was unmasked
        finally:
            for p in parties:
                p.close()


def test_the_rank_is_bound_into_the_signed_advertisement_and_the_rule_is_the_t_th_largest_rank():
    ctx, key = secagg.context("t", 0, "n"), masking.KeyPair(masking.Secret()).public
    assert signatures.advertisement(ctx, "a", key, key, bytes(32), 4) != \
        signatures.advertisement(ctx, "a", key, key, bytes(32), 8)
    assert ranks.held_rank([8, 4, 4], 2) == 4 and ranks.held_rank([8, 8, 4], 2) == 8
    assert ranks.held_rank([16, 8, 8, 2], 3) == 8 and ranks.held_rank([8], 2) == 0
    assert ranks.thinly_held([8, 4, 4], 2) == 8 and ranks.thinly_held([4, 4, 4], 2) == 0
    assert ranks.thinly_held([8, 8, 4], 3) == 8 and ranks.thinly_held([8, 8, 4], 2) == 0
    adapter = ranks.zero_above(ranks.padded(doubles(lora_base(8)), 8, 1.0), 4)
    a, b = adapter["base_model.model.layer0.lora_A.weight"], adapter["base_model.model.layer0.lora_B.weight"]
    assert torch.equal(a[4:], torch.zeros(4, IN)) and a[:4].abs().sum() > 0
    assert b.shape == (OUT, 8)
