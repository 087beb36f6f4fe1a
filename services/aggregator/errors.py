"""The aggregator's domain errors; the servicer maps each to a gRPC status code. Every message
tells the caller what to do."""

from __future__ import annotations


class FederationError(Exception):
    """Base class; the message tells the caller what to do."""


class NotJoined(FederationError):
    pass


class StaleRound(FederationError):
    pass


class NotSelected(FederationError):
    """The client is not among the clients the open round takes (RunConfig.selector)."""


class SchemaMismatch(FederationError):
    pass


class RunFinished(FederationError):
    pass


class NotAvailable(FederationError):
    pass


class DuplicateUpload(FederationError):
    pass


class ResumeMismatch(FederationError):
    """An upload or download resumed from an offset that does not match what is held."""


class Superseded(FederationError):
    """A newer stream of the same upload took over; this one stops."""
