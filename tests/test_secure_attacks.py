"""Attacks by an aggregator that holds a federation certificate, run as its operator would run them:
certificates made with `fedse certs` as the join guide says (an offline CA, a server certificate for
the aggregator, a member certificate per organisation from its own request), the real aggregator
behind a servicer that edits its answers (lying_aggregator.py), and fedse's real client code, in
threads and in a client process. Each attack is refused before the victim uploads or reveals in the
attempt it aims at, with a reason that names what was wrong:
- signatures harvested in an abandoned attempt, replayed under a reused round nonce, or under a new
  one by a client that lost its record of nonces;
- the aggregator's own server certificate, or one naming the aggregator, in the roster as a member;
- a masking ring thinner than the client's own least ring, and a federation too small to withstand
  one colluder;
- a client moved between run ids, back to a round it revealed in;
- a client restarted mid-round, shown its attempt again from key advertisement.
"""

from __future__ import annotations

import contextlib
import pathlib
import subprocess
import sys
import types

import pytest

from fedse.security import certs

from fedse.privacy import masking

from fedse.transport import reach

from fedse.privacy import secagg

from fedse.security import signatures
from fedse.security.admission import Security
from fedse.v1 import federation_pb2 as fpb
from lying_aggregator import at_least, lying_aggregator
from secure_party import Party
from services.client_agent.federation import secure_checks
from services.client_agent.federation.secure import Protection
from support import Pki
from test_secure_lying import finish, refused

ROOT = pathlib.Path(__file__).resolve().parents[1]


class FederationPki:
    """The files a federation hands out, made with fedse.security.certs as `fedse certs` makes them: the CA (kept
    here, as on the operator's offline machine), the aggregator's server certificate for 127.0.0.1 and
    localhost, and a member certificate per organisation, signed from the organisation's own request."""

    def __init__(self, root: pathlib.Path):
        self.root = root
        certs.init_ca(root / "ca")
        self.ca_pem = str(root / "ca" / certs.CA_CERT)
        certs.issue(root / "ca", "aggregator", ["localhost"], ["127.0.0.1"], root)
        self.server = (str(root / "aggregator.pem"), str(root / "aggregator-key.pem"))
        self._members: dict[str, tuple[str, str]] = {}

    def member(self, client_id: str) -> tuple[str, str]:
        if client_id not in self._members:
            own = self.root / client_id
            certs.request(client_id, own)
            certs.sign(self.root / "ca", own / f"{client_id}.csr", own / f"{client_id}.pem")
            self._members[client_id] = (str(own / f"{client_id}.pem"), str(own / f"{client_id}-key.pem"))
        return self._members[client_id]


@pytest.fixture(scope="module")
def fpki(tmp_path_factory) -> FederationPki:
    return FederationPki(tmp_path_factory.mktemp("federation"))


@contextlib.contextmanager
def federation(tmp_path, fpki: FederationPki, n: int, protect: dict | None = None, **settings):
    """A lying aggregator over mTLS with the federation's server certificate, and `n` joined parties
    org-0.. with member certificates; `protect` maps an index to more Protection fields."""
    over = {"tls_ca": fpki.ca_pem, "tls_cert": fpki.server[0], "tls_key": fpki.server[1], **settings}
    with lying_aggregator(tmp_path / "agg", start_clients=n, **over) as (agg, port, run_dir, liar):
        target = f"127.0.0.1:{port}"
        parties = [Party.signed(target, f"org-{i}", 100 + i, fpki, cert_key=fpki.member(f"org-{i}"),
                                protect=(protect or {}).get(i)).join() for i in range(n)]
        try:
            yield agg, liar, parties, target
        finally:
            for p in parties:
                p.close()


def reuse_nonces(monkeypatch) -> None:
    """The aggregator opens every attempt under one round nonce."""
    import services.aggregator.rounds as rounds_module

    monkeypatch.setattr(rounds_module, "secrets", types.SimpleNamespace(token_hex=lambda n=16: "a" * (2 * n)))


def abandon_at_consistency(agg, harvested: list[dict]) -> None:
    """The first attempt is abandoned once every uploader signed its list; the signatures are kept."""
    desk = agg.federation.secure
    real_advance = desk.advance

    def advance(accepted, now):
        a = desk.attempt
        if a.stage.value == "consistency" and not harvested:
            harvested.append(dict(a.signed))
            return "abandoned by the attacker after the consistency signatures"
        return real_advance(accepted, now)

    desk.advance = advance


# ---- replayed signatures -------------------------------------------------------------------------------
def test_an_attempt_reopened_under_a_used_nonce_is_refused(tmp_path, fpki, monkeypatch):
    """The attacker abandons an attempt once it holds every consistency signature and opens the next under
    the same nonce, to show those signatures as the new attempt's. Every client refuses the reused nonce
    before it advertises keys again: nobody uploads twice, nobody reveals."""
    reuse_nonces(monkeypatch)
    harvested: list[dict] = []
    with federation(tmp_path, fpki, 4) as (agg, liar, parties, target):
        abandon_at_consistency(agg, harvested)
        results = finish(parties)
        assert harvested and len(harvested[0]) == 4
        assert all(refused(r, "a reused round nonce", "signed in") for r in results), results
        assert sorted(liar.uploaders) == [f"org-{i}" for i in range(4)], "one masked upload each, none again"
        assert liar.unmasked_by == []


def test_signatures_of_an_abandoned_attempt_verify_in_no_other(tmp_path, fpki, monkeypatch):
    """As above, and then the same members as clients that kept no record of nonces (restarted on a fresh
    state directory) take part in the attempt under the reused nonce: the attacker shows org-2 and org-3 a
    list without org-0 (the victim), and org-0 and org-1 the whole list with the signatures every client
    made of it in the abandoned attempt. Those bind that attempt's roster (its keys were fresh), so they
    verify in no other: nobody holds the threshold of signatures of its list, and nobody reveals."""
    reuse_nonces(monkeypatch)
    harvested: list[dict] = []
    group_b = {"org-2", "org-3"}

    def two_lists(cid, sr):
        if not harvested or not at_least(fpb.SECURE_STAGE_CONSISTENCY)(sr):
            return
        if cid in group_b:
            kept = [c for c in sr.uploaded if c != "org-0"]
            sr.ClearField("uploaded")
            sr.uploaded.extend(kept)
        elif sr.stage == fpb.SECURE_STAGE_UNMASKING:
            sr.ClearField("consistency")
            sr.consistency.extend(fpb.UploaderSignature(client_id=c, signature=s) for c, s in harvested[0].items())

    def take_b(req):
        if req.client_id not in group_b or not harvested:
            return False
        with agg.federation._cond:
            agg.federation.secure.attempt.signed[req.client_id] = req.signature
        return True

    with federation(tmp_path, fpki, 4, secure_stage_timeout_s=4.0) as (agg, liar, parties, target):
        abandon_at_consistency(agg, harvested)
        assert all(refused(r, "a reused round nonce") for r in finish(parties))
        assert harvested, "the first attempt reached the consistency stage"
        liar.secure_lies.append(two_lists)
        liar.consistency_takeover = take_b
        restarted = [Party.signed(target, p.client_id, p.seed, fpki, cert_key=fpki.member(p.client_id)).join()
                     for p in parties]
        try:
            results = finish(restarted)
        finally:
            for p in restarted:
                p.close()
        assert [len(liar.uploaders), "org-0" in liar.uploaders[4:]] == [8, True], "all took part again"
        assert refused(results[0], "signed the uploader list it was shown", "fewer than the threshold")
        assert refused(results[1], "signed the uploader list it was shown", "fewer than the threshold")
        assert liar.unmasked_by == []


def test_a_consistency_signature_binds_the_whole_attempt():
    ctx = secagg.context("run", 3, "nonce")
    base = dict(ctx=ctx, client_id="org-0", threshold=3, degree=0, roster_digest=b"d" * 32, uploaders=["a", "b"])
    message = signatures.consistency(**base)
    for change in ({"ctx": secagg.context("run", 4, "nonce")}, {"ctx": secagg.context("other", 3, "nonce")},
                   {"ctx": secagg.context("run", 3, "other")}, {"threshold": 2}, {"degree": 4},
                   {"roster_digest": b"e" * 32}, {"uploaders": ["a"]}, {"client_id": "org-1"}):
        assert signatures.consistency(**{**base, **change}) != message, change


# ---- the aggregator as a member ---------------------------------------------------------------------------
def sybil(signer, identity: str):
    """A lie: the aggregator enrols itself, under `identity` with keys of its own signed by `signer`,
    in org-0's roster."""
    def lie(cid, sr):
        if cid != "org-0" or not at_least(fpb.SECURE_STAGE_SHARING)(sr):
            return
        ctx = secagg.context("t", sr.round, sr.round_nonce)
        enc, mask = masking.KeyPair(masking.Secret()).public, masking.KeyPair(masking.Secret()).public
        commitment = bytes(32)
        sr.roster.append(fpb.RosterMember(
            client_id=identity, encryption_key=enc, masking_key=mask, self_mask_commitment=commitment,
            index=len(sr.roster) + 1, certificate=signer.der,
            signature=signer.sign(signatures.advertisement(ctx, identity, enc, mask, commitment))))
    return lie


def test_the_aggregator_s_server_certificate_is_no_member(tmp_path, fpki):
    signer = Protection.of(0.5, fpki.ca_pem, *fpki.server).signer
    identity = certs.identity(signer.certificate)  # the first name `fedse certs issue` gave it
    with federation(tmp_path, fpki, 3) as (agg, liar, parties, target):
        liar.secure_lies.append(sybil(signer, identity))
        results = finish(parties)
        assert refused(results[0], f"{identity}'s certificate is for server", "not for client authentication")
        assert parties[0].steps == ["advertised"] and "org-0" not in liar.uploaders
        assert results[1:] == [True, True]


def test_a_member_certificate_naming_the_aggregator_is_no_member(tmp_path, fpki):
    """A CA that issues certificates for both purposes (trustme's, here) gives the aggregator one that
    passes as a client's: the client reads the aggregator's names from its TLS certificate and refuses a
    member named like it."""
    (tmp_path / "dual").mkdir()
    other = Pki(tmp_path / "dual")
    with lying_aggregator(tmp_path / "agg", start_clients=3, tls_ca=other.ca_pem, tls_cert=other.server[0],
                          tls_key=other.server[1]) as (agg, port, run_dir, liar):
        target = f"127.0.0.1:{port}"
        cert, key = other.issue(other.ca, "org-0", "org-0")
        names = reach.server_names(target, Security(tls_ca=other.ca_pem, tls_cert=cert, tls_key=key))
        assert {"127.0.0.1", "localhost"} <= names
        parties = [Party.signed(target, f"org-{i}", 100 + i, other, protect={"aggregator_names": names}).join()
                   for i in range(3)]
        signer = Protection.of(0.5, other.ca_pem, *other.server).signer
        liar.secure_lies.append(sybil(signer, "localhost"))
        try:
            results = finish(parties)
        finally:
            for p in parties:
                p.close()
        assert refused(results[0], "localhost's certificate names the aggregator")
        assert "org-0" not in liar.uploaders


def test_a_roster_member_off_the_member_list_is_refused(tmp_path, fpki):
    stranger = fpki.member("org-9")
    listed = frozenset({"org-0", "org-1", "org-2"})
    with federation(tmp_path, fpki, 3, protect={0: {"members": listed}}) as (agg, liar, parties, target):
        liar.secure_lies.append(sybil(Protection.of(0.5, fpki.ca_pem, *stranger).signer, "org-9"))
        results = finish(parties)
        assert refused(results[0], "org-9, not on the federation's member list")
        assert "org-0" not in liar.uploaders


def test_a_client_agent_reads_its_protection_from_its_settings(tmp_path, fpki):
    """`fedse client`'s settings give the protection above: the CA-signed member list checked against
    --tls-ca (a list the aggregator edited is refused at once), the aggregator's names from its TLS
    certificate, and the organisation's own bounds."""
    from fedse.security import members
    from fedse.config import ConfigError
    from services.client_agent.config import ClientConfig
    from services.client_agent.federation.secure import client_protection

    listed = tmp_path / "members.json"
    members.sign_member_list(fpki.root / "ca", ["org-0", "org-1", "org-2"], listed)
    cert, key = fpki.member("org-0")
    with lying_aggregator(tmp_path / "agg", start_clients=2, tls_ca=fpki.ca_pem, tls_cert=fpki.server[0],
                          tls_key=fpki.server[1]) as (agg, port, run_dir, liar):
        cfg = ClientConfig(client_id="org-0", aggregator=f"127.0.0.1:{port}", tls_ca=fpki.ca_pem, tls_cert=cert,
                           tls_key=key, secure_members=str(listed), secure_tolerate_colluders=2,
                           secure_dropout_rate=0.1, metrics_port=-1)
        protection = client_protection(cfg, tmp_path)
    assert protection.members == {"org-0", "org-1", "org-2"} and protection.signed
    assert {"127.0.0.1", "localhost"} <= protection.aggregator_names
    assert (protection.min_colluders, protection.dropout_rate) == (2, 0.1)
    listed.write_text(listed.read_text().replace('"org-2"', '"org-9"'))
    with pytest.raises(ConfigError, match="--secure-members"):
        client_protection(cfg, tmp_path)
    plain = tmp_path / "members.txt"
    plain.write_text("org-0\norg-1\n")
    assert client_protection(ClientConfig(secure_members=str(plain), metrics_port=-1), tmp_path).members == \
        {"org-0", "org-1"}


# ---- thin rings and small federations ---------------------------------------------------------------------
def roster_of(n: int, ctx: bytes) -> tuple[secagg.Participant, fpb.SecureRound]:
    me = secagg.Participant("org-000", ctx)
    sr = fpb.SecureRound(round=0, round_nonce="n", stage=fpb.SECURE_STAGE_SHARING, threshold=2)
    for i in range(n):
        cid = f"org-{i:03d}"
        keys = (me.sealing.public, me.masking.public, me.self_commitment) if i == 0 else (
            masking.KeyPair(masking.Secret()).public, masking.KeyPair(masking.Secret()).public, bytes(32))
        sr.roster.append(fpb.RosterMember(client_id=cid, index=i + 1, encryption_key=keys[0], masking_key=keys[1],
                                          self_mask_commitment=keys[2]))
    return me, sr


def test_a_ring_thinner_than_the_client_s_own_is_refused():
    """2 neighbours in a roster of 100 (a neighbourhood of 3, threshold 2), which the aggregator itself
    would refuse below 7: the client computes its own least ring and refuses."""
    me, sr = roster_of(100, secagg.context("t", 0, "n"))
    with pytest.raises(secagg.SecureError, match="with 2 neighbours in a roster of 100: this client requires at "
                                                 "least 7"):
        secure_checks.check_roster(sr, me, Protection(), degree=2)
    sr.threshold = 6
    view = secure_checks.check_roster(sr, me, Protection(), degree=8)  # 8 >= 7: a neighbourhood of 9
    assert len(view.graph["org-000"]) == 9


@pytest.mark.parametrize("n, t, signed, withstood", [
    (2, 2, False, 0), (3, 2, False, 0), (4, 3, False, 1), (5, 3, False, 1),
    (2, 2, True, 0), (3, 2, True, 0), (3, 3, True, 1), (4, 3, True, 1), (5, 3, True, 0), (5, 4, True, 2),
    (7, 7, True, 5), (30, 21, True, 11)])
def test_colluders_withstood(n, t, signed, withstood):
    """At t = n every share is needed, yet t - 1 colluding uploaders beside the victim leave its adapter
    as the sum less theirs: the bound is min(2t - n, t - 1) colluders (exclusive), not 2t - n."""
    assert secure_checks.tolerated(t, n, signed) == withstood


def test_a_federation_too_small_to_withstand_a_colluder_is_refused_unless_allowed():
    me, sr = roster_of(3, secagg.context("t", 0, "n"))
    with pytest.raises(secagg.SecureError, match="withstands 0 colluding neighbour.* --secure-tolerate-colluders 0"):
        secure_checks.check_roster(sr, me, Protection(), degree=0)
    secure_checks.check_roster(sr, me, Protection(min_colluders=0), degree=0)
    sr.threshold = 3
    with pytest.raises(secagg.SecureError, match="withstands 1 colluding"):
        secure_checks.check_roster(sr, me, Protection(min_colluders=2), degree=0)


def test_a_ring_is_refused_over_real_grpc(tmp_path, fpki):
    """The aggregator's operator claims a 0.1 % dropout rate to run a 2-neighbour ring over 8 clients;
    clients expecting 5 % (the default) refuse it before dealing a share."""
    n = 8
    protect = {i: {"dropout_rate": 0.001} for i in range(1, n)}
    with federation(tmp_path, fpki, n, protect=protect, secure_neighbours=2, secure_max_roster=n,
                    secure_dropout_rate=0.001, secure_stage_timeout_s=3.0) as (agg, liar, parties, target):
        threads = [p.start() for p in parties]
        threads[0].join(30)
        assert refused(parties[0].result, "with 2 neighbours in a roster of 8", "requires at least 5")
        assert parties[0].steps == ["advertised"]
        for t in threads[1:]:
            t.join(0.1)


# ---- run ids ------------------------------------------------------------------------------------------
def test_a_client_moved_between_run_ids_reveals_in_a_round_once(tmp_path):
    """The attacker runs round 0 as run A, then as run B, then as run A again, the victim's state
    directory kept throughout: it takes part in A and in B, and refuses A's round 0 the second time
    before anything of it leaves (another sum with the same release would give the difference)."""
    from services.client_agent.federation.secure import ReleaseBook
    from services.client_agent.federation.secure_checks import SeenAttempts

    state = tmp_path / "victim"
    state.mkdir()
    outcomes = []
    for i, run in enumerate(("A", "B", "A")):
        with lying_aggregator(tmp_path / f"agg-{i}", start_clients=3, run_id=run) as (agg, port, run_dir, liar):
            target = f"127.0.0.1:{port}"
            victim = Party(target, "org-0", 100, protection=Protection(
                book=ReleaseBook(state / "secure_released.json"), min_colluders=0,
                attempts=SeenAttempts(state / "secure_attempts.txt"))).join()
            parties = [victim] + [Party(target, f"org-{j}", 100 + j).join() for j in (1, 2)]
            try:
                results = finish(parties)
            finally:
                for p in parties:
                    p.close()
            outcomes.append((victim.config.run_id, results[0], "org-0" in liar.uploaders, victim.steps))
    assert [o[:3] for o in outcomes[:2]] == [("A", True, True), ("B", True, True)]
    run_id, result, uploaded, steps = outcomes[2]
    assert run_id == "A" and refused(result, "already revealed shares", "round 0") and not uploaded and steps == []


# ---- a restart mid-round ------------------------------------------------------------------------------------
def test_a_restarted_client_shown_its_attempt_again_refuses(tmp_path, monkeypatch):
    """A client process is killed after its masked upload; the attacker abandons the attempt and opens the
    next under the same nonce, which the restarted process (its keys and draws gone, its state directory
    kept) would otherwise take part in afresh. It refuses, naming the reused nonce, and uploads nothing
    more."""
    reuse_nonces(monkeypatch)
    with lying_aggregator(tmp_path / "agg", start_clients=3, secure_stage_timeout_s=2.0) as (agg, port, run_dir, liar):
        target = f"127.0.0.1:{port}"
        others = [Party(target, f"org-{i}", 100 + i).join() for i in (1, 2)]
        state = tmp_path / "victim"
        command = [sys.executable, str(ROOT / "tests" / "secure_party.py"), target, "org-0", "100", "--state-dir",
                   str(state)]
        env = {"PYTHONPATH": f"{ROOT}:{ROOT / 'tests'}", "PATH": "/usr/bin:/bin"}
        victim = subprocess.Popen(command + ["--hold-at", "uploaded"], stdout=subprocess.PIPE, text=True, env=env,
                                  cwd=ROOT)
        for p in others:
            p.hold_if = lambda party, step: step == "uploaded"  # the round stalls at consistency/unmasking
            p.start()
        try:
            for line in victim.stdout:
                if line.strip() == "AT uploaded":
                    break
            victim.kill()
            victim.wait(10)
            with agg.federation._cond:  # the attacker abandons the attempt: a new one, the same nonce
                agg.federation._new_attempt_locked("abandoned by the attacker")
                agg.federation._changed_locked()
            again = subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT, timeout=60)
        finally:
            victim.kill()
            for p in others:
                p.close()
        assert again.returncode == 3, again.stdout + again.stderr[-2000:]
        assert "REFUSED" in again.stdout and "at key advertisement again" in again.stdout
        assert "already uploaded in" in again.stdout
        assert liar.uploaders.count("org-0") == 1


def test_a_member_list_that_does_not_verify_stops_the_client_at_start(tmp_path, fpki):
    from fedse.security import members
    from fedse.config import ConfigError
    from services.client_agent.config import ClientConfig

    listed = tmp_path / "members.json"
    members.sign_member_list(fpki.root / "ca", ["org-0", "org-1"], listed)
    listed.write_text(listed.read_text().replace('"org-1"', '"org-2"'))
    cert, key = fpki.member("org-0")
    with pytest.raises(ConfigError, match="--secure-members: .*not signed by the federation CA"):
        ClientConfig(tls_ca=fpki.ca_pem, tls_cert=cert, tls_key=key, secure_members=str(listed), metrics_port=-1)
    with pytest.raises(ConfigError, match="give --tls-ca to check it"):
        ClientConfig(secure_members=str(listed), metrics_port=-1)
    with pytest.raises(ConfigError, match="--secure-members"):
        ClientConfig(secure_members=str(tmp_path / "missing.txt"), metrics_port=-1)
