"""Bearer tokens of the REST API and the two roles they grant.

`admin` tokens may read and change runs; `viewer` tokens may only read. Tokens are loaded once at
start-up (see `__main__`), compared in constant time against every configured token (no early exit,
so timing does not reveal which one nearly matched), and never appear in a repr or a log line.
Knows nothing about HTTP frameworks.
"""

from __future__ import annotations

import enum
import hmac
from dataclasses import dataclass

MIN_TOKEN_CHARS = 16


class Role(str, enum.Enum):
    VIEWER = "viewer"
    ADMIN = "admin"

    def allows(self, needed: Role) -> bool:
        return self == Role.ADMIN or needed == Role.VIEWER


def check_token(name: str, token: str) -> str:
    """token if it is long enough and has no whitespace; ValueError naming it (never its value)."""
    if len(token) < MIN_TOKEN_CHARS or any(c.isspace() for c in token):
        raise ValueError(
            f"{name} must be at least {MIN_TOKEN_CHARS} characters without whitespace "
            f"(got {len(token)} characters)"
        )
    return token


@dataclass(frozen=True)
class ApiTokens:
    admin: tuple[str, ...]
    viewer: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.admin:
            raise ValueError("at least one admin token is required")
        for i, token in enumerate(self.admin):
            check_token(f"admin token #{i + 1}", token)
        for i, token in enumerate(self.viewer):
            check_token(f"viewer token #{i + 1}", token)
        if set(self.admin) & set(self.viewer):
            raise ValueError("a token cannot be both an admin and a viewer token")

    def role_for(self, given: str) -> Role | None:
        """The role the token grants, or None; constant time in the configured tokens."""
        raw = given.encode()
        role = None
        for candidate_role, tokens in ((Role.ADMIN, self.admin), (Role.VIEWER, self.viewer)):
            for token in tokens:
                if hmac.compare_digest(raw, token.encode()) and role is None:
                    role = candidate_role
        return role

    def __repr__(self) -> str:
        return f"ApiTokens(admin=<{len(self.admin)} redacted>, viewer=<{len(self.viewer)} redacted>)"
