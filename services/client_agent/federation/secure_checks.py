"""What a client checks of a secure attempt's roster before it deals a share, against an aggregator
that may lie (services.client_agent.federation.secure follows the stages), and the attempts it has taken part in.

The roster (`check_roster`) must be one this organisation's own settings accept, whatever the
aggregator says:
- every member is a member: no key twice, its own entry holds its own keys, and with signed keys each
  member's certificate chains to the federation's CA, names the member, is a client certificate (not
  a CA's, not a server's: the aggregator's own certificate is no member) naming none of the
  aggregator's names, and signed the member's keys; with the federation's member list
  (--secure-members), every member is on it;
- the threshold is at least its floor and at most its neighbourhood;
- the masking graph is no thinner than this client's own least ring (secagg.min_neighbours of the
  roster's size at its own --secure-dropout-rate), whatever RunConfig.secure_neighbours says;
- the attempt withstands at least --secure-tolerate-colluders colluding neighbours (`tolerated`):
  at small sizes, where none is tolerated, the client says so and refuses unless its organisation
  set 0.

An attempt is known by its round nonce, which must be new (`SeenAttempts`, kept in the state
directory): a client never advertises keys twice under one nonce, so signatures it showed in an
abandoned attempt can never be shown again as if from a later one.
"""

from __future__ import annotations

import dataclasses
import hashlib
import pathlib
from typing import TYPE_CHECKING

from fedse.privacy import fixedpoint

from fedse.privacy import secagg

from fedse.security import signatures
from fedse.security import members as member_lists
from fedse.config import ConfigError
from fedse.files import atomic_write
from fedse.privacy.secagg import Member, Participant, SecureError
from fedse.security.signatures import SignatureError
from fedse.v1 import federation_pb2 as fpb

if TYPE_CHECKING:
    from services.client_agent.federation.secure import Protection

REFUSE = "this client will not take part"


class NotInRoster(Exception):
    """This client's keys are not in the roster: it sits the attempt out (not a lie: it came late)."""


@dataclasses.dataclass
class View:
    """What this client holds of an attempt once the roster is checked."""

    roster: dict[str, Member]
    threshold: int
    graph: dict[str, frozenset[str]]
    certificates: dict
    digest: bytes  # secagg.roster_digest: what the consistency signatures bind


def tolerated(threshold: int, members: int, signed: bool) -> int:
    """Colluding neighbours a neighbourhood of `members` withstands at `threshold`, the victim aside.
    Uploads of at least `threshold` of a neighbourhood (the victim's one of them) make a sum, so with
    threshold - 1 colluders among them the sum less theirs is the victim's adapter: at most
    threshold - 2. Against an aggregator that lies (signed keys, else it cannot be withstood at all) it
    also needs `threshold` shares of both of the victim's seeds, and each honest member reveals one:
    c colluders get them once c >= 2 * threshold - members, so at most 2 * threshold - members - 1."""
    most = threshold - 2
    if signed:
        most = min(most, 2 * threshold - members - 1)
    return max(most, 0)


def check_roster(sr: fpb.SecureRound, me: Participant, protection: "Protection", degree: int) -> View:
    """The attempt's roster, graph and threshold, checked against this client's own protection;
    SecureError naming what it refuses, NotInRoster when its keys came too late."""
    roster = {m.client_id: Member(m.client_id, m.index, m.encryption_key, m.masking_key, m.self_mask_commitment,
                                  m.certificate, m.signature, m.lora_rank) for m in sr.roster}
    mine = roster.get(me.client_id)
    if mine is None:
        raise NotInRoster("our keys arrived after key advertisement closed")
    if len(roster) != len(sr.roster) or len(roster) > fixedpoint.MAX_CLIENTS:
        raise SecureError(f"the roster names a client twice or holds more than {fixedpoint.MAX_CLIENTS}: {REFUSE}")
    if sorted(m.index for m in roster.values()) != list(range(1, len(roster) + 1)):
        raise SecureError(f"the roster's share indices are not 1..n: {REFUSE}")
    if (mine.encryption_key, mine.masking_key, mine.self_commitment) != \
            (me.sealing.public, me.masking.public, me.self_commitment):
        raise SecureError(f"the roster's entry for this client holds keys that are not its own: {REFUSE}")
    keys = [k for m in roster.values() for k in (m.encryption_key, m.masking_key)]
    if len(set(keys)) != len(keys):
        raise SecureError(f"two roster entries share a key: {REFUSE}")
    strangers = sorted(set(roster) - protection.members) if protection.members else []
    if strangers:
        raise SecureError(f"the roster holds {', '.join(strangers[:5])}{' ...' if len(strangers) > 5 else ''}, not on "
                          f"the federation's member list (--secure-members): {REFUSE}")
    certificates = _certificates(roster, me, protection)
    digest = secagg.roster_digest(me.ctx, roster.values())
    graph = secagg.neighbours(sorted(roster), me.ctx, degree, digest)
    near = graph[me.client_id]
    _check_graph(len(roster), len(near), protection)
    least = secagg.floor(len(near), protection.min_threshold)
    if not least <= sr.threshold <= len(near):
        raise SecureError(f"the aggregator asks for a threshold of {sr.threshold} in a neighbourhood of "
                          f"{len(near)}: this client requires {least} to {len(near)} (--secure-min-threshold "
                          f"{protection.min_threshold:g}): {REFUSE}")
    withstood = tolerated(int(sr.threshold), len(near), protection.signed)
    if withstood < protection.min_colluders:
        raise SecureError(
            f"a threshold of {sr.threshold} in a neighbourhood of {len(near)} withstands {withstood} colluding "
            f"neighbour(s){' against an aggregator that lies' if protection.signed else ''}, fewer than the "
            f"{protection.min_colluders} this client requires (--secure-tolerate-colluders): with so few members "
            f"the others could learn its adapter; {REFUSE} (set --secure-tolerate-colluders 0 to accept it)")
    return View(roster, int(sr.threshold), graph, certificates, digest)


def _certificates(roster: dict[str, Member], me: Participant, protection: "Protection") -> dict:
    """With signed keys: every member's checked certificate (its own too: its signature of the
    uploader list counts like the others'); SecureError for one that is no member's or did not sign."""
    verifier = protection.verifier
    if verifier is None:
        return {}
    out = {}
    for m in roster.values():
        try:
            cert = verifier.member(m.certificate, m.client_id, protection.aggregator_names)
            verifier.signature(cert, signatures.advertisement(me.ctx, m.client_id, m.encryption_key, m.masking_key,
                                                              m.self_commitment, m.lora_rank), m.signature,
                               f"{m.client_id}'s signature of its keys")
        except SignatureError as exc:
            raise SecureError(f"{exc}: {REFUSE}") from None
        out[m.client_id] = cert
    return out


def _check_graph(members: int, near: int, protection: "Protection") -> None:
    """SecureError where the masking graph is sparser than this client's own least ring for a roster
    of `members` at its own dropout rate (a thinner ring splits, or seats few enough around it)."""
    least = secagg.min_neighbours(members, protection.dropout_rate)
    if near - 1 < least:
        raise SecureError(f"the aggregator masks each client with {near - 1} neighbours in a roster of {members}: "
                          f"this client requires at least {least} there (--secure-dropout-rate "
                          f"{protection.dropout_rate:g}): {REFUSE}")


class SeenAttempts:
    """The attempts (round nonces) this client advertised keys in, and how far it got in each, kept in
    a file (None: in memory only) so that a restarted client remembers. Nonces are kept as digests."""

    def __init__(self, path: pathlib.Path | None = None):
        self.path = path
        self._steps: dict[str, str] = {}
        if path is not None and path.exists():
            for line in path.read_text().splitlines():
                key, _, step = line.partition(" ")
                if key:
                    self._steps[key] = step

    @staticmethod
    def _key(nonce: str) -> str:
        return hashlib.sha256(nonce.encode()).hexdigest()[:32]

    def step(self, nonce: str) -> str | None:
        """How far this client got in the attempt of `nonce` ("advertised", "shared", ...), None if never
        in it."""
        return self._steps.get(self._key(nonce))

    def mark(self, nonce: str, step: str) -> None:
        """Records that this client reached `step` in the attempt, before the step's message leaves."""
        self._steps[self._key(nonce)] = step
        if self.path is not None:
            atomic_write(self.path, "".join(f"{k} {s}\n" for k, s in self._steps.items()).encode())


def load_members(path: str, tls_ca: str) -> frozenset[str]:
    """The federation's member list (--secure-members): a list the CA signed (`fedse certs members`),
    checked against the federation's CA certificate (`tls_ca`), or a plain file of one client id a
    line, given to the client by its organisation. ConfigError saying what is wrong otherwise."""
    file = pathlib.Path(path)
    try:
        if not member_lists.is_signed(file):
            return member_lists.read_plain_list(file)
        if not tls_ca:
            raise ConfigError(f"--secure-members {path} is signed by the federation's CA: give --tls-ca to check it")
        return member_lists.read_member_list(file, pathlib.Path(tls_ca).read_bytes())
    except ConfigError:
        raise
    except (OSError, ValueError) as exc:
        raise ConfigError(f"--secure-members: {exc}") from None
