"""What an organisation releases under secure aggregation, held against an aggregator that lies about run
ids and restarts: its noise is drawn once per (round, adapter) and is the same after a restart
(ReleaseBook.draw), the rounds it revealed in are kept for every run id it was told, and with mixed
ranks its clip counts only the components it holds."""

from __future__ import annotations

import hashlib
import json
import stat
import subprocess
import sys

import pytest
import torch

from fedse.model import ranks

from fedse.privacy import secagg
from fedse.v1 import federation_pb2 as fpb
from secure_party import SCHEMA, base_adapter, trained
from services.client_agent.federation.secure import AttemptOver, Contribution, Protection, ReleaseBook, SecureRound

NOISY = fpb.RunConfig(run_id="t", strategy="fedavg", clip_norm=1.0, noise_multiplier=0.5)


def masked_values(book_path, round_=0, seed=1, t=3, config=NOISY) -> str:
    """SHA-256 of the encoded vector a client with the book at `book_path` masks (before its masks) for
    the adapter of `seed`, in an attempt of threshold `t`; a new SecureRound each time, as after a restart."""
    secure = SecureRound(None, config.run_id, config, secagg.Layout.of(SCHEMA, "fedavg"), 1,
                         Protection(book=ReleaseBook(book_path)))
    c = Contribution({k: v.double() for k, v in trained(seed).items()}, base_adapter(), 1)
    values = secure._noised_values(round_, c, t)
    return hashlib.sha256(secure.layout.encode(values, 1).tobytes()).hexdigest()


def test_a_restarted_client_masks_the_same_noise_for_the_same_round_and_adapter(tmp_path):
    book = tmp_path / "org-a" / "secure_released.json"
    first = masked_values(book)
    assert masked_values(book) == first  # a new SecureRound and book from the same state directory
    # A new process from the same state directory, too.
    script = ("import sys; sys.path.insert(0, 'tests'); import pathlib, test_releases as t; "
              f"print(t.masked_values(pathlib.Path({str(book)!r})))")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == first
    assert masked_values(book, t=4) == first  # a higher threshold: the same values (more noise than needed)
    with pytest.raises(AttemptOver, match="threshold 2 is below the 3"):
        masked_values(book, t=2)  # kept across restarts: re-scaling the draw would give the values away
    # Another round, another adapter, another organisation: independent draws.
    assert len({first, masked_values(book, round_=1), masked_values(book, seed=2),
                masked_values(tmp_path / "org-b" / "secure_released.json")}) == 4
    unnoised = SecureRound(None, "t", fpb.RunConfig(strategy="fedavg", clip_norm=1.0),
                           secagg.Layout.of(SCHEMA, "fedavg"))
    assert first != hashlib.sha256(secagg.Layout.of(SCHEMA, "fedavg").encode(unnoised._noised_values(
        0, Contribution({k: v.double() for k, v in trained(1).items()}, base_adapter(), 1), 3), 1).tobytes()
    ).hexdigest(), "noise was added"
    key = book.with_name("secure_noise.key")
    assert stat.S_IMODE(key.stat().st_mode) == 0o600 and len(key.read_bytes()) == 32
    assert key.read_bytes().hex() not in book.read_text()  # the book holds draw ids and thresholds only


def test_the_release_book_keeps_every_run_it_revealed_in(tmp_path):
    path = tmp_path / "secure_released.json"
    book = ReleaseBook(path)
    book.mark("A", 0)
    book.mark("B", 0)  # the aggregator switched the client to run B ...
    assert book.has("A", 0) and book.has("B", 0) and not book.has("A", 1)  # ... and back to A: still revealed
    again = ReleaseBook(path)  # a restarted client
    assert again.has("A", 0) and again.has("B", 0)
    old = tmp_path / "old.json"  # the format that kept one run
    old.write_text(json.dumps({"run_id": "A", "rounds": [0, 2]}))
    migrated = ReleaseBook(old)
    assert migrated.has("A", 0) and migrated.has("A", 2) and not migrated.has("B", 0)
    migrated.mark("B", 1)
    assert ReleaseBook(old).has("A", 2) and json.loads(old.read_text())["revealed"] == [["A", 0], ["A", 2], ["B", 1]]


def test_a_client_switched_between_run_ids_does_not_reveal_again(tmp_path):
    from test_secure_lying import federation, refused

    book = ReleaseBook(tmp_path / "released.json")
    book.mark("t", 0)  # it revealed in round 0 of run t (the lying aggregator's run id) ...
    book.mark("B", 0)  # ... then was told run B, and revealed there too
    with federation(tmp_path, 2, parties={0: {"protection": Protection(book=ReleaseBook(book.path))}}) as (
            agg, liar, parties):
        assert parties[0].config.run_id == "t"  # ... and now run t again
        parties[0].start().join(30)
        assert refused(parties[0].result, "already revealed shares", "round 0")
        assert parties[0].steps == []


def lora_pair(rank: int, gen: torch.Generator, scale: float = 1.0) -> dict[str, torch.Tensor]:
    return {f"m{i}{part}weight": scale * torch.randn(shape, generator=gen, dtype=torch.float64)
            for i in range(2) for part, shape in ((ranks.A_PART, (rank, 16)), (ranks.B_PART, (24, rank)))}


def test_a_rank_4_client_in_a_rank_8_run_clips_only_its_own_components():
    gen = torch.Generator().manual_seed(7)
    previous = lora_pair(8, gen)  # the run's rank-8 global adapter
    own = {n: t + 0.5 * torch.randn(t.shape, generator=gen, dtype=torch.float64)
           for n, t in ranks.truncated(previous, 4, 1.0).items()}  # the client trained its rank-4 part
    padded = ranks.padded(own, 8, 1.0)
    held = ranks.held(padded, 4)
    clip = 0.5

    def update_norm(values):
        return float(sum(((values[n] - previous[n]) * held[n]).pow(2).sum() for n in values)) ** 0.5

    assert update_norm(padded) > clip
    out = secagg.clip_and_noise(padded, previous, clip, 0.0, held=held)
    assert update_norm(out) == pytest.approx(clip)  # the clip on its own components, not scaled down further
    assert all(torch.equal(out[n][~held[n]], padded[n][~held[n]]) for n in out)  # padding left as it is
    counted_all = secagg.clip_and_noise(padded, previous, clip, 0.0)  # the padding counted too: far less
    assert update_norm(counted_all) < clip / 2
    # Through the client's secure round: Contribution.rank marks what it holds.
    config = fpb.RunConfig(run_id="t", strategy="zero-pad", clip_norm=clip, max_lora_rank=8)
    schema = ranks.run_schema(secagg_schema(previous), 8)
    secure = SecureRound(None, "t", config, secagg.Layout.of(schema, "zero-pad"))
    values = secure._noised_values(0, Contribution(padded, previous, 1, rank=4), 3)
    assert update_norm(values) == pytest.approx(clip)


def secagg_schema(adapter):
    from fedse.model.adapter import Schema

    return Schema.of(adapter, json.dumps({"r": 8, "lora_alpha": 8, "peft_type": "LORA"}))


def test_a_new_run_sets_the_run_s_files_aside_and_keeps_the_organisation_s(tmp_path):
    from services.client_agent.resume import Progress, write_progress
    from services.client_agent.state import ORGANISATION, StateDir

    state = StateDir(tmp_path / "org-a")
    write_progress(state.path / "progress.json", Progress("run-a", 3, "reported"))
    state.save_upload(b"adapter")
    book = ReleaseBook(state.path / "secure_released.json")
    book.mark("run-a", 3)
    book.draw(3, b"release", 2)  # makes the noise secret
    (state.path / "privacy.json").write_text('{"version": 2, "releases": [["run-a", 3, 2.0]], "declined": []}')
    kept = {name: (state.path / name).read_bytes() for name in ORGANISATION if (state.path / name).exists()}
    assert set(kept) >= {"secure_released.json", "secure_noise.key", "privacy.json"}
    assert state.set_aside(Progress("run-a", 3, "reported"))  # the aggregator now says run B
    aside = next(tmp_path.glob("org-a.aside-run-a-*"))
    assert sorted(p.name for p in aside.iterdir()) == ["progress.json", "upload.safetensors"]
    assert {name: (state.path / name).read_bytes() for name in kept} == kept  # the organisation's stay
    assert ReleaseBook(state.path / "secure_released.json").has("run-a", 3)
