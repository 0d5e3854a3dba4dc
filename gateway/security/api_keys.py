"""API keys of the gateway: the key store, per-key quotas and the access policy.

Owns the key-file syntax, keeping keys only as SHA-256 digests compared in
constant time, one token bucket per key, and the one policy both frontends
apply (:meth:`KeyStore.check`); the HTTP middleware and the gRPC interceptor
that enforce it live in ``gateway.security.frontend_auth``.

An API key file holds one key a line::

    # comment
    KEY                                   every model, no quota
    KEY simple,mlp                        only these models (space or comma separated)
    KEY * rate=100/m burst=20 name=batch  every model, 100 requests a minute

``rate=N/s`` (or ``/m``, ``/h``) is a token bucket: ``burst`` requests at
once (default N, at least 1), refilled at N per unit. ``name=`` labels the
key in logs and errors (default ``key-`` and 8 hex digits of its digest). An
admin key file holds ``KEY [name=LABEL]`` lines. Keys are at least 16
characters without white space; error messages name the line, never the key.

Outcomes: no or unknown key -> Unauthenticated (401 / UNAUTHENTICATED) with a
generic message; a model outside the key's list -> PermissionDenied (403),
naming only the model asked for; an empty bucket -> QuotaExceeded (429 /
RESOURCE_EXHAUSTED) with the seconds until the next token.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import logging
import math
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from gateway.settings import ConfigError, SecuritySettings
from protos.errors import PermissionDenied, QuotaExceeded, Unauthenticated

log = logging.getLogger(__name__)

MIN_KEY_CHARS = 16
ALL_MODELS = "*"
_RATE = re.compile(r"^(?P<count>\d+(?:\.\d+)?)/(?P<unit>s|sec|m|min|h|hour)$")
_UNIT_S = {"s": 1.0, "sec": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0, "hour": 3600.0}
_OPTIONS = ("rate", "burst", "name")

UNAUTHENTICATED_MESSAGE = "missing or invalid API key"
ADMIN_MESSAGE = "missing or invalid admin key"


def digest(secret: str) -> bytes:
    return hashlib.sha256(secret.encode("utf-8")).digest()


@dataclass(frozen=True, slots=True)
class ApiKey:
    """One API key as held in memory: its digest, never the key."""

    name: str
    digest: bytes = field(repr=False)
    models: frozenset[str] | None = None  # None: every model
    rate_per_s: float | None = None       # None: no quota
    burst: int = 0
    rate_text: str = ""                   # as written, for messages ("10/s")

    def may_use(self, model: str) -> bool:
        return self.models is None or model in self.models


@dataclass(frozen=True, slots=True)
class AdminKey:
    name: str
    digest: bytes = field(repr=False)


class Access(enum.Enum):
    """What a call needs; the frontends classify, :meth:`KeyStore.check` decides."""

    OPEN = "open"              # health: Kubernetes probes carry no key
    API = "api"                # any valid API key (server metadata, unknown paths)
    MODEL = "model"            # an API key that may use the named model
    ALL_MODELS = "all_models"  # an API key for every model (answers list every model)
    ADMIN = "admin"            # the admin key (or, without admin keys, an every-model API key)


# ---- parsing ---------------------------------------------------------------------


def _check_key(key: str, where: str) -> None:
    if len(key) < MIN_KEY_CHARS:
        raise ConfigError(f"{where}: key is shorter than {MIN_KEY_CHARS} characters; "
                          "make one with: python -c 'import secrets; print(secrets.token_urlsafe(32))'")


def _split_options(tokens: Sequence[str], where: str) -> tuple[list[str], dict[str, str]]:
    plain: list[str] = []
    options: dict[str, str] = {}
    for token in tokens:
        name, sep, value = token.partition("=")
        if not sep:
            plain.append(token)
            continue
        if name not in _OPTIONS:
            raise ConfigError(f"{where}: unknown option {name!r}; options are {', '.join(_OPTIONS)}")
        if name in options or not value:
            raise ConfigError(f"{where}: option {name!r} needs one value")
        options[name] = value
    return plain, options


def parse_rate(text: str, where: str) -> float:
    """``N/s``, ``N/m`` or ``N/h`` as requests per second."""
    match = _RATE.match(text)
    if match is None or float(match["count"]) <= 0:
        raise ConfigError(f"{where}: rate must look like 10/s, 600/m or 1000/h, got {text!r}")
    return float(match["count"]) / _UNIT_S[match["unit"]]


def parse_key_line(line: str, where: str) -> ApiKey | None:
    """One line of an API key file; None for blank lines and comments."""
    tokens = line.split("#", 1)[0].split()
    if not tokens:
        return None
    key, rest = tokens[0], tokens[1:]
    _check_key(key, where)
    plain, options = _split_options(rest, where)
    names = [m for token in plain for m in token.split(",") if m]
    models = None if not names or ALL_MODELS in names else frozenset(names)
    key_digest = digest(key)
    rate_per_s: float | None = None
    burst = 0
    if "rate" in options:
        rate_per_s = parse_rate(options["rate"], where)
        count = float(options["rate"].split("/", 1)[0])
        burst = max(1, math.ceil(count))
    elif "burst" in options:
        raise ConfigError(f"{where}: burst= needs a rate=")
    if "burst" in options:
        if not options["burst"].isdigit() or int(options["burst"]) < 1:
            raise ConfigError(f"{where}: burst must be a positive integer, got {options['burst']!r}")
        burst = int(options["burst"])
    name = options.get("name") or f"key-{key_digest.hex()[:8]}"
    return ApiKey(name, key_digest, models, rate_per_s, burst, options.get("rate", ""))


def parse_admin_line(line: str, where: str) -> AdminKey | None:
    tokens = line.split("#", 1)[0].split()
    if not tokens:
        return None
    key, rest = tokens[0], tokens[1:]
    _check_key(key, where)
    plain, options = _split_options(rest, where)
    if plain or set(options) - {"name"}:
        raise ConfigError(f"{where}: an admin key line is KEY [name=LABEL]")
    key_digest = digest(key)
    return AdminKey(options.get("name") or f"admin-{key_digest.hex()[:8]}", key_digest)


def _lines(text: str, source: str, split_semicolons: bool) -> list[tuple[str, str]]:
    lines = text.replace(";", "\n").splitlines() if split_semicolons else text.splitlines()
    return [(line, f"{source} line {n}") for n, line in enumerate(lines, 1)]


def _read(path: str, what: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read the {what} file {path}: {exc}") from None


def parse_keys(text: str, source: str, *, split_semicolons: bool = False) -> list[ApiKey]:
    keys = [k for line, where in _lines(text, source, split_semicolons) if (k := parse_key_line(line, where))]
    _no_duplicates(keys, source)
    return keys


def parse_admin_keys(text: str, source: str, *, split_semicolons: bool = False) -> list[AdminKey]:
    keys = [k for line, where in _lines(text, source, split_semicolons) if (k := parse_admin_line(line, where))]
    _no_duplicates(keys, source)
    return keys


def _no_duplicates(keys: Sequence[ApiKey | AdminKey], source: str) -> None:
    seen: set[bytes] = set()
    for key in keys:
        if key.digest in seen:
            raise ConfigError(f"{source}: key {key.name!r} is listed twice")
        seen.add(key.digest)


# ---- quotas ----------------------------------------------------------------------


class TokenBucket:
    """``burst`` tokens, refilled at ``rate_per_s``; one token a request.

    Only touched from the event loop (both frontends run on it), so taking a
    token needs no lock.
    """

    def __init__(self, rate_per_s: float, burst: int, now: float) -> None:
        if rate_per_s <= 0 or burst < 1:
            raise ValueError("a token bucket needs a positive rate and burst")
        self.rate_per_s = rate_per_s
        self.burst = burst
        self._tokens = float(burst)
        self._stamp = now

    def take(self, now: float) -> float:
        """0.0 when a token was taken; else the seconds until one will be there."""
        elapsed = max(0.0, now - self._stamp)
        self._tokens = min(float(self.burst), self._tokens + elapsed * self.rate_per_s)
        self._stamp = max(self._stamp, now)
        if self._tokens >= 1.0:
            self._tokens -= 1.0
            return 0.0
        return (1.0 - self._tokens) / self.rate_per_s


# ---- the store and the policy -----------------------------------------------------


def _match(secret: str | None, keys: Sequence[ApiKey] | Sequence[AdminKey]) -> ApiKey | AdminKey | None:
    """The key whose digest equals the secret's, comparing with every key in
    constant time (no early exit) so timing tells nothing about the keys."""
    if secret is None:
        return None
    presented = digest(secret)
    found = None
    for key in keys:
        if hmac.compare_digest(key.digest, presented):
            found = key
    return found


class KeyStore:
    """The API and admin keys, and the quota state of each API key."""

    def __init__(
        self,
        api_keys: Sequence[ApiKey] = (),
        admin_keys: Sequence[AdminKey] = (),
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._api_keys = tuple(api_keys)
        self._admin_keys = tuple(admin_keys)
        clash = {k.digest for k in self._api_keys} & {k.digest for k in self._admin_keys}
        if clash:
            raise ConfigError("a key is both an API key and an admin key; give each its own")
        self._clock = clock
        now = clock()
        self._buckets = {
            k.digest: TokenBucket(k.rate_per_s, k.burst, now) for k in self._api_keys if k.rate_per_s is not None
        }

    @property
    def api_keys_enabled(self) -> bool:
        return bool(self._api_keys)

    @property
    def admin_keys_enabled(self) -> bool:
        return bool(self._admin_keys)

    def __len__(self) -> int:
        return len(self._api_keys) + len(self._admin_keys)

    def authenticate(self, secret: str | None) -> ApiKey:
        key = _match(secret, self._api_keys)
        if not isinstance(key, ApiKey):
            raise Unauthenticated(UNAUTHENTICATED_MESSAGE)
        return key

    def charge(self, key: ApiKey) -> None:
        bucket = self._buckets.get(key.digest)
        if bucket is None:
            return
        wait_s = bucket.take(self._clock())
        if wait_s > 0:
            log.debug("API key %s over its quota (%s)", key.name, key.rate_text)
            raise QuotaExceeded(f"API key '{key.name}' is over its quota ({key.rate_text}); retry in {wait_s:.1f}s",
                                retry_after_s=wait_s)

    def check(self, access: Access, secret: str | None, model: str = "") -> ApiKey | AdminKey | None:
        """Allow the call or raise Unauthenticated / PermissionDenied / QuotaExceeded.

        Order: who (401) before what (403) before how often (429), so a call
        that is refused costs its key no quota.
        """
        if access is Access.OPEN:
            return None
        if access is Access.ADMIN:
            if self._admin_keys:
                admin = _match(secret, self._admin_keys)
                if admin is None:
                    raise Unauthenticated(ADMIN_MESSAGE)
                return admin
            # Without admin keys the admin endpoints take an API key that may
            # see every model: their answers list every model.
            access = Access.ALL_MODELS
        if not self._api_keys:
            return None
        key = self.authenticate(secret)
        if access is Access.MODEL and not key.may_use(model):
            raise PermissionDenied(f"API key '{key.name}' may not use model '{model}'")
        if access is Access.ALL_MODELS and key.models is not None:
            raise PermissionDenied(f"API key '{key.name}' is limited to some models; "
                                   "this call needs a key for every model (ask about one model instead)")
        self.charge(key)
        return key


def load_key_store(security: SecuritySettings, *, clock: Callable[[], float] = time.monotonic) -> KeyStore | None:
    """The keys named by the ``security`` settings (files and environment), or None when there are none."""
    api_keys: list[ApiKey] = []
    admin_keys: list[AdminKey] = []
    if security.api_key_file:
        api_keys += parse_keys(_read(security.api_key_file, "API key"), security.api_key_file)
        if not api_keys:
            raise ConfigError(f"API key file {security.api_key_file} holds no key")
    if security.api_keys_env.strip():
        api_keys += parse_keys(security.api_keys_env, "INFERGATE_API_KEYS", split_semicolons=True)
    if security.admin_key_file:
        admin_keys += parse_admin_keys(_read(security.admin_key_file, "admin key"), security.admin_key_file)
        if not admin_keys:
            raise ConfigError(f"admin key file {security.admin_key_file} holds no key")
    if security.admin_keys_env.strip():
        admin_keys += parse_admin_keys(security.admin_keys_env, "INFERGATE_ADMIN_KEYS", split_semicolons=True)
    _no_duplicates(api_keys, "API keys")
    _no_duplicates(admin_keys, "admin keys")
    if not api_keys and not admin_keys:
        return None
    log.info("authentication on: %d API key(s), %d admin key(s)", len(api_keys), len(admin_keys))
    return KeyStore(api_keys, admin_keys, clock=clock)
