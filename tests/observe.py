"""Observing the client's scorer and writer from outside, by wrapping their objects' methods: what
the tests of scoring and generation count, which the client itself has no use for."""

from __future__ import annotations


def returns(obj, name: str) -> list:
    """Wraps obj's method `name` (on the object only): every call's return value is appended to the
    list returned."""
    seen: list = []
    real = getattr(obj, name)

    def wrapper(*args, **kwargs):
        out = real(*args, **kwargs)
        seen.append(out)
        return out
    setattr(obj, name, wrapper)
    return seen


class PrefixReuse:
    """Counts what a scorer's prefix cache (prefixes.PrefixCache) saved, by wrapping its lookup: the
    lookups that reused a cached prompt (`hits`), the prompt tokens reused (`reused`) and those the
    passes then computed (`computed`)."""

    def __init__(self, cache):
        self.hits = self.reused = self.computed = 0
        real = cache.lookup

        def lookup(ids, limit):
            start, kv = real(ids, limit)
            self.hits += start > 0
            self.reused += start
            self.computed += len(ids) - start
            return start, kv
        cache.lookup = lookup
