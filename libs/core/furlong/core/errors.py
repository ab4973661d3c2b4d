"""Domain errors every service raises and every transport maps to its own status codes.

`ValueError` (bad input, naming the bad value) and `TimeoutError` are used as they are; these add the
cases that need a distinct status. Mapping to gRPC codes lives in `furlong.rpc`, to HTTP in the
controller.
"""


class FurlongError(Exception):
    """Base class of Furlong's domain errors."""


class NotFoundError(FurlongError):
    """A named thing (run, engine, version) does not exist."""


class ConflictError(FurlongError):
    """The request is valid but not in the current state: a stale or duplicate version, an illegal
    state transition, a step out of order."""


class UnavailableError(FurlongError):
    """A dependency (another service, Redis, a transfer peer) cannot be reached right now."""


class IntegrityError(FurlongError):
    """Bytes that arrived do not match their checksum, or data failed validation after transport."""
