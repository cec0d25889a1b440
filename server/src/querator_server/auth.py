"""API keys: who may call what, on which queues.

A key is ``qk_<key_id>_<secret>``. The server keeps only a SHA-256 of the secret
(in the catalog), so a copy of the data dir does not leak usable tokens. A key has a
role and shell-style queue-name patterns; every call is checked against both
*before* its queue is looked up, so a caller cannot learn which queues exist.

With authentication on, a bootstrap admin token (given to the server at start, never
stored) lets an operator create the first keys. It is as strong as an admin key for
every queue, so ``querator serve`` asks for one as hard to guess as a key's secret
(see check_bootstrap_token), warns while it stays usable next to real keys, and can
retire it by itself once an admin key for every queue exists (``bootstrap_until_key``).
"""

from __future__ import annotations

import enum
import fnmatch
import hashlib
import hmac
import re
import secrets
from collections.abc import Iterable
from dataclasses import dataclass

from .errors import InvalidArgument, NotFound, PermissionDenied, Unauthenticated
from .logging import get_logger


class Role(enum.IntEnum):
    PRODUCER = 1
    CONSUMER = 2
    ADMIN = 3


class Action(enum.Enum):
    PRODUCE = "produce"
    CONSUME = "consume"
    READ = "read"  # get a queue, its stats
    LIST = "list"  # list queues (answers are filtered by pattern)
    ADMIN = "admin"  # change queues, storage calls
    KEYS = "keys"  # manage API keys


_GRANTS: dict[Role, frozenset[Action]] = {
    Role.PRODUCER: frozenset({Action.PRODUCE, Action.READ, Action.LIST}),
    Role.CONSUMER: frozenset({Action.CONSUME, Action.READ, Action.LIST}),
    Role.ADMIN: frozenset({Action.PRODUCE, Action.CONSUME, Action.READ, Action.LIST, Action.ADMIN, Action.KEYS}),
}

log = get_logger("auth")

# A bootstrap token must hold at least 256 bits, like a key's secret
# (secrets.token_urlsafe(32): 43 characters). The server cannot measure randomness, so
# it checks what it can: the length of a 32-byte value in URL-safe base64, and enough
# different characters that a repeated or trivial pattern is refused (a random 43-char
# token has about 30 different ones; a 64-char hex one all 16 but for ~1e-12 odds of 9).
BOOTSTRAP_MIN_CHARS = 43
BOOTSTRAP_MIN_DISTINCT = 10


def check_bootstrap_token(token: str) -> str:
    """Why ``token`` is too weak to be the bootstrap admin token ("" when it is fine)."""
    if len(token) < BOOTSTRAP_MIN_CHARS:
        return (
            f"QUERATOR_ADMIN_TOKEN has {len(token)} characters; it needs at least {BOOTSTRAP_MIN_CHARS} "
            "(32 random bytes: openssl rand -base64 32)"
        )
    if len(set(token)) < BOOTSTRAP_MIN_DISTINCT:
        return (
            f"QUERATOR_ADMIN_TOKEN uses {len(set(token))} different characters; a random token has far more "
            "(openssl rand -base64 32)"
        )
    if any(ch.isspace() for ch in token):
        return "QUERATOR_ADMIN_TOKEN must not contain whitespace (a bearer token cannot carry it)"
    return ""


_TOKEN = re.compile(r"qk_([0-9a-f]{16})_([A-Za-z0-9_-]{20,100})")


@dataclass(frozen=True, slots=True)
class ApiKey:
    key_id: str
    role: Role
    queues: tuple[str, ...]
    description: str
    created_at_us: int
    secret_hash: str


@dataclass(frozen=True, slots=True)
class Principal:
    """Who is calling: the key's id (or "bootstrap"), role and queue patterns."""

    key_id: str
    role: Role
    queues: tuple[str, ...]

    def may(self, action: Action) -> bool:
        if action not in _GRANTS[self.role]:
            return False
        return action is not Action.KEYS or "*" in self.queues

    def matches(self, queue: str) -> bool:
        return any(fnmatch.fnmatchcase(queue, pattern) for pattern in self.queues)

    def check(self, action: Action, queues: Iterable[str] = ()) -> None:
        if not self.may(action):
            raise PermissionDenied(f"key {self.key_id} ({self.role.name.lower()}) may not {action.value}")
        for queue in queues:
            if queue and not self.matches(queue):
                raise PermissionDenied(f"key {self.key_id} may not touch this queue")


def _digest(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def new_key(role: Role, queues: Iterable[str], description: str, now_us: int) -> tuple[ApiKey, str]:
    """A fresh key and its token (the only time the token exists in clear)."""
    patterns = tuple(queues)
    if not patterns:
        raise InvalidArgument("queues", "name at least one queue pattern, e.g. 'orders*' or '*'")
    for index, pattern in enumerate(patterns):
        if not pattern or len(pattern) > 512 or any(ch.isspace() for ch in pattern):
            raise InvalidArgument(f"queues[{index}]", "must be 1..512 characters without whitespace")
    if len(description) > 1024:
        raise InvalidArgument("description", "must be at most 1024 characters")
    key_id = secrets.token_hex(8)
    secret = secrets.token_urlsafe(32)
    key = ApiKey(key_id, role, patterns, description, now_us, _digest(secret))
    return key, f"qk_{key_id}_{secret}"


class KeyRing:
    """The keys in force, checked in memory on every call."""

    def __init__(
        self, keys: Iterable[ApiKey] = (), *, bootstrap_token: str = "", bootstrap_until_key: bool = False
    ) -> None:
        self._keys = {key.key_id: key for key in keys}
        self._bootstrap = _digest(bootstrap_token) if bootstrap_token else ""
        # Refuse the bootstrap token while an admin key for every queue exists.
        self._bootstrap_until_key = bootstrap_until_key
        self._warned_used = False
        self._warned_active = False
        self._logged_retired = False

    @property
    def bootstrap_retired(self) -> bool:
        """Whether the bootstrap token is refused now (it retires once an admin key for
        every queue exists, when asked to; revoking the last such key brings it back)."""
        return self._bootstrap_until_key and any(
            key.role is Role.ADMIN and "*" in key.queues for key in self._keys.values()
        )

    def authenticate(self, metadata: Iterable[tuple[str, str | bytes]]) -> Principal:
        token = ""
        for name, value in metadata:
            if name == "authorization" and isinstance(value, str):
                scheme, _, rest = value.partition(" ")
                if scheme.lower() == "bearer":
                    token = rest.strip()
        if not token:
            raise Unauthenticated("this server needs an API key: send 'authorization: Bearer <token>'")
        if self._bootstrap and hmac.compare_digest(_digest(token), self._bootstrap):
            if self.bootstrap_retired:
                raise Unauthenticated(
                    "the bootstrap admin token is retired: an admin key for every queue exists, use an API key"
                )
            if self._keys and not self._warned_used:
                self._warned_used = True
                log.warning(
                    "bootstrap_token_used",
                    keys=len(self._keys),
                    detail="the bootstrap admin token is still in use while API keys exist; retire it "
                    "(docs/operations.md, Retiring the bootstrap token)",
                )
            return Principal("bootstrap", Role.ADMIN, ("*",))
        match = _TOKEN.fullmatch(token)
        key = self._keys.get(match.group(1)) if match else None
        if key is None or match is None or not hmac.compare_digest(_digest(match.group(2)), key.secret_hash):
            raise Unauthenticated("the API key is not valid (revoked, mistyped or from another server)")
        return Principal(key.key_id, key.role, key.queues)

    def add(self, key: ApiKey) -> None:
        self._keys[key.key_id] = key
        self.warn_if_bootstrap_active()

    def warn_if_bootstrap_active(self) -> None:
        """Log, once, that the bootstrap token is still usable although keys exist, and
        once that it retired itself. Called at start and whenever a key is added."""
        if not self._bootstrap or not self._keys:
            return
        if self.bootstrap_retired:
            if not self._logged_retired:
                self._logged_retired = True
                log.info("bootstrap_token_retired", detail="an admin key for every queue exists; the token is refused")
            return
        if self._warned_active:
            return
        self._warned_active = True
        retire = (
            "it retires once an admin key for every queue ('*') exists"
            if self._bootstrap_until_key
            else "retire it: unset it and restart, or set QUERATOR_ADMIN_TOKEN_UNTIL_KEY=true"
        )
        log.warning(
            "bootstrap_token_active",
            keys=len(self._keys),
            detail=f"API keys exist but QUERATOR_ADMIN_TOKEN still acts as an admin key for every queue; {retire} "
            "(docs/operations.md, Retiring the bootstrap token)",
        )

    def remove(self, key_id: str) -> ApiKey:
        key = self._keys.pop(key_id, None)
        if key is None:
            raise NotFound(f"no key with id {key_id[:40]!r}")
        return key

    def get(self, key_id: str) -> ApiKey:
        key = self._keys.get(key_id)
        if key is None:
            raise NotFound(f"no key with id {key_id[:40]!r}")
        return key

    def keys(self) -> list[ApiKey]:
        return [self._keys[k] for k in sorted(self._keys)]
