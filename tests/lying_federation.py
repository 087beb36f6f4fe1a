"""A federation of fedse's real secure-aggregation clients around a lying aggregator
(lying_aggregator.py), for the tests of secure aggregation against one (tests/test_secure_lying*.py):
the federation itself, running its parties to the end, and what they publish or refuse."""

from __future__ import annotations

import contextlib

import torch

from fedse.model import adapter as ad
from fedse.privacy import secagg
from lying_aggregator import lying_aggregator
from secure_party import Party, close_to
from support import Pki


def mtls(pki: Pki) -> dict:
    return {"tls_ca": pki.ca_pem, "tls_cert": pki.server[0], "tls_key": pki.server[1]}


@contextlib.contextmanager
def federation(tmp_path, n: int, pki: Pki | None = None, parties: dict | None = None, **settings):
    """A lying aggregator (signed keys over mTLS where `pki` is given) and `n` joined parties org-0..;
    `parties` maps an index to extra Party settings."""
    over = {**(mtls(pki) if pki else {}), **settings}
    with lying_aggregator(tmp_path / "agg", start_clients=n, **over) as (agg, port, run_dir, liar):
        target = f"127.0.0.1:{port}"
        made = []
        for i in range(n):
            kw = {**(parties or {}).get(i, {})}
            made.append(Party.signed(target, f"org-{i}", 100 + i, pki, **kw) if pki else
                        Party(target, f"org-{i}", 100 + i, **kw))
        made = [p.join() for p in made]
        try:
            yield agg, liar, made
        finally:
            for p in made:
                p.close()


def finish(parties, timeout=60.0):
    threads = [p.start() for p in parties]
    for t in threads:
        t.join(timeout)
    return [p.result for p in parties]


def mean_of(parties) -> dict[str, torch.Tensor]:
    return {k: sum(p.adapter[k].double() for p in parties) / len(parties) for k in parties[0].adapter}


def assert_published(party, want, round_=1):
    glob = ad.decode(party.fed.download(round_).data)
    for name, t in want.items():
        assert close_to(glob[name], t), name


def refused(result, *words: str) -> bool:
    return isinstance(result, secagg.SecureError) and all(w in str(result) for w in words)
