"""API keys, quotas and the access policy (gateway/security/api_keys.py), how the
frontends classify calls (gateway/security/frontend_auth.py), the security config
(gateway/config.py, gateway/security/setup.py) and the worker's token check
(workers/auth.py). No sockets: a fake clock, mocked requests.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
from aiohttp import web
from aiohttp.test_utils import make_mocked_request
from tritonclient.grpc import service_pb2

from gateway.config import load_config
from gateway.security import api_keys as auth
from gateway.security.api_keys import (
    Access,
    AdminKey,
    KeyStore,
    TokenBucket,
    load_key_store,
    parse_admin_keys,
    parse_key_line,
    parse_keys,
)
from gateway.security.frontend_auth import _check, grpc_access, grpc_secret, http_access, http_auth_middleware, http_secret
from gateway.security.setup import GatewaySecurity, local_worker_token, worker_client_factory
from gateway.settings import ConfigError, SecuritySettings, WorkerSpec
from protos import wire
from protos.errors import PermissionDenied, QuotaExceeded, Unauthenticated
from workers.auth import TokenInterceptor, WorkerAuthError, WorkerSecurity

FULL = "full-access-key-0123456789"
ONLY = "restricted-key-0123456789"
LIMITED = "limited-rate-key-0123456789"
ADMIN = "admin-key-abcdefghijklmnop"


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def store(clock: FakeClock | None = None, *, admin: bool = True) -> KeyStore:
    keys = parse_keys(f"{FULL}\n{ONLY} secretmodel,other name=narrow\n{LIMITED} * rate=2/s burst=2 name=lim\n", "keys")
    admins = parse_admin_keys(f"{ADMIN} name=ops\n", "admin") if admin else []
    return KeyStore(keys, admins, clock=clock or FakeClock())


# ---- parsing ------------------------------------------------------------------------


def test_a_bare_key_may_use_every_model_without_quota() -> None:
    key = parse_key_line(f"  {FULL}  # the operator's key", "f line 1")
    assert key is not None
    assert key.models is None and key.rate_per_s is None and key.may_use("anything")
    assert key.digest == hashlib.sha256(FULL.encode()).digest()
    assert key.name == f"key-{key.digest.hex()[:8]}"


@pytest.mark.parametrize("models", ["a,b", "a b", "a, b", "a,b,"])
def test_models_may_be_comma_or_space_separated(models: str) -> None:
    key = parse_key_line(f"{FULL} {models}", "f line 1")
    assert key is not None and key.models == frozenset({"a", "b"})
    assert key.may_use("a") and not key.may_use("c")


def test_star_means_every_model() -> None:
    key = parse_key_line(f"{FULL} * rate=10/s", "f line 1")
    assert key is not None and key.models is None


@pytest.mark.parametrize(
    ("rate", "burst", "per_s", "want_burst"),
    [("10/s", None, 10.0, 10), ("600/m", None, 10.0, 600), ("7200/h", "3", 2.0, 3), ("0.5/s", None, 0.5, 1)],
)
def test_rate_and_burst(rate: str, burst: str | None, per_s: float, want_burst: int) -> None:
    line = f"{FULL} mlp rate={rate}" + (f" burst={burst}" if burst else "")
    key = parse_key_line(line, "f line 1")
    assert key is not None
    assert key.rate_per_s == pytest.approx(per_s) and key.burst == want_burst and key.rate_text == rate


def test_blank_lines_and_comments_hold_no_key() -> None:
    assert parse_key_line("   ", "f") is None
    assert parse_key_line("# KEY mlp", "f") is None
    assert [k.name for k in parse_keys(f"\n# c\n{FULL} name=a\n\n{ONLY} name=b\n", "f")] == ["a", "b"]


@pytest.mark.parametrize(
    "line",
    [
        "short-key mlp",
        f"{FULL} rate=10/d",
        f"{FULL} rate=0/s",
        f"{FULL} rate=ten/s",
        f"{FULL} burst=3",
        f"{FULL} rate=1/s burst=0",
        f"{FULL} colour=blue",
        f"{FULL} rate=1/s rate=2/s",
    ],
)
def test_bad_lines_are_config_errors_that_do_not_echo_the_key(line: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_key_line(line, "keys.txt line 3")
    assert "keys.txt line 3" in str(info.value)
    assert line.split()[0] not in str(info.value)


def test_a_key_listed_twice_is_refused_without_naming_it() -> None:
    with pytest.raises(ConfigError) as info:
        parse_keys(f"{FULL} a\n{FULL} b\n", "keys.txt")
    assert FULL not in str(info.value)


def test_admin_lines_take_only_a_name() -> None:
    (key,) = parse_admin_keys(f"{ADMIN} name=ops", "admin")
    assert key.name == "ops" and key.digest == hashlib.sha256(ADMIN.encode()).digest()
    with pytest.raises(ConfigError):
        parse_admin_keys(f"{ADMIN} mlp", "admin")


def test_keys_are_held_as_digests_only() -> None:
    keys = store()
    text = repr(keys._api_keys) + repr(keys._admin_keys)  # noqa: SLF001
    for secret in (FULL, ONLY, LIMITED, ADMIN):
        assert secret not in text
        assert hashlib.sha256(secret.encode()).hexdigest() not in text


def test_keys_are_compared_in_constant_time_against_every_key(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[bytes, bytes]] = []
    real = auth.hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(auth.hmac, "compare_digest", spy)
    keys = store()
    assert keys.authenticate(FULL).digest == hashlib.sha256(FULL.encode()).digest()  # the first key
    # No early exit: all three API keys compared, each against the digest, never the key.
    assert len(calls) == 3 and all(b == hashlib.sha256(FULL.encode()).digest() for _, b in calls)


# ---- quotas -----------------------------------------------------------------------


def test_token_bucket_allows_a_burst_then_the_rate() -> None:
    bucket = TokenBucket(rate_per_s=1.0, burst=2, now=0.0)
    assert bucket.take(0.0) == 0.0 and bucket.take(0.0) == 0.0
    assert bucket.take(0.0) == pytest.approx(1.0)
    assert bucket.take(0.5) == pytest.approx(0.5)
    assert bucket.take(1.0) == 0.0
    # A long idle time refills up to the burst, no more.
    assert [bucket.take(100.0) for _ in range(3)] == [0.0, 0.0, pytest.approx(1.0)]


def test_a_clock_going_backwards_refills_nothing() -> None:
    bucket = TokenBucket(rate_per_s=1.0, burst=1, now=10.0)
    assert bucket.take(10.0) == 0.0
    assert bucket.take(5.0) > 0


def test_quota_per_key_with_retry_after() -> None:
    clock = FakeClock()
    keys = store(clock)
    keys.check(Access.API, LIMITED)
    keys.check(Access.API, LIMITED)
    with pytest.raises(QuotaExceeded) as info:
        keys.check(Access.MODEL, LIMITED, "mlp")
    assert info.value.retry_after_s == pytest.approx(0.5)
    assert "lim" in info.value.message
    for _ in range(10):
        keys.check(Access.API, FULL)  # other keys are not limited by it
    clock.now += 0.5
    keys.check(Access.API, LIMITED)


def test_refused_calls_cost_no_quota() -> None:
    keys = KeyStore(parse_keys(f"{ONLY} a rate=1/h", "k"), clock=FakeClock())
    for _ in range(5):
        with pytest.raises(PermissionDenied):
            keys.check(Access.MODEL, ONLY, "b")
    keys.check(Access.MODEL, ONLY, "a")
    with pytest.raises(QuotaExceeded):
        keys.check(Access.MODEL, ONLY, "a")


# ---- policy -----------------------------------------------------------------------


@pytest.mark.parametrize("secret", [None, "", "wrong-key-0123456789", FULL + "x", ADMIN])
@pytest.mark.parametrize("access", [Access.API, Access.MODEL, Access.ALL_MODELS])
def test_no_or_wrong_key_is_unauthenticated_with_a_generic_message(secret: str | None, access: Access) -> None:
    with pytest.raises(Unauthenticated) as info:
        store().check(access, secret, "secretmodel")
    assert info.value.message == auth.UNAUTHENTICATED_MESSAGE


def test_health_is_open_to_everyone() -> None:
    assert store().check(Access.OPEN, None) is None


def test_a_model_outside_the_list_is_denied_naming_only_that_model() -> None:
    keys = store()
    assert keys.check(Access.MODEL, ONLY, "secretmodel") is not None
    with pytest.raises(PermissionDenied) as info:
        keys.check(Access.MODEL, ONLY, "mlp")
    assert "'mlp'" in info.value.message
    assert "secretmodel" not in info.value.message and "other" not in info.value.message


def test_calls_about_every_model_need_an_unrestricted_key() -> None:
    keys = store()
    keys.check(Access.ALL_MODELS, FULL)
    with pytest.raises(PermissionDenied):
        keys.check(Access.ALL_MODELS, ONLY)


def test_admin_calls_need_the_admin_key() -> None:
    keys = store()
    assert isinstance(keys.check(Access.ADMIN, ADMIN), AdminKey)
    for secret in (None, FULL, "x" * 20):
        with pytest.raises(Unauthenticated) as info:
            keys.check(Access.ADMIN, secret)
        assert info.value.message == auth.ADMIN_MESSAGE
    # The admin key is no API key.
    with pytest.raises(Unauthenticated):
        keys.check(Access.MODEL, ADMIN, "mlp")


def test_without_admin_keys_admin_calls_take_an_unrestricted_api_key() -> None:
    keys = store(admin=False)
    keys.check(Access.ADMIN, FULL)
    with pytest.raises(PermissionDenied):
        keys.check(Access.ADMIN, ONLY)
    with pytest.raises(Unauthenticated):
        keys.check(Access.ADMIN, None)


def test_admin_keys_alone_leave_the_api_open() -> None:
    keys = KeyStore((), parse_admin_keys(ADMIN, "a"))
    assert keys.check(Access.MODEL, None, "mlp") is None
    with pytest.raises(Unauthenticated):
        keys.check(Access.ADMIN, None)


def test_one_key_cannot_be_both_api_and_admin() -> None:
    with pytest.raises(ConfigError):
        KeyStore(parse_keys(FULL, "k"), parse_admin_keys(FULL, "a"))


# ---- config: files and environment --------------------------------------------------


def test_keys_from_files_and_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "keys").write_text(f"{FULL}\n")
    (tmp_path / "admin").write_text(f"{ADMIN}\n")
    (tmp_path / "gw.yaml").write_text("security:\n  api_key_file: keys\n  admin_key_file: admin\n"
                                      "api_keys_env: from-yaml-0123456789\n")
    monkeypatch.setenv("INFERGATE_API_KEYS", f"{ONLY} mlp ; {LIMITED} rate=1/s")
    config = load_config(tmp_path / "gw.yaml")
    # Paths in the file are relative to it; secrets come from the environment only.
    assert config.security.api_key_file == str(tmp_path / "keys")
    assert config.security.admin_key_file == str(tmp_path / "admin")
    assert ONLY in config.security.api_keys_env and "from-yaml" not in config.security.api_keys_env
    assert ONLY not in repr(config)
    keys = load_key_store(config.security)
    assert keys is not None and len(keys) == 4
    keys.check(Access.MODEL, ONLY, "mlp")
    keys.check(Access.MODEL, FULL, "mlp")
    with pytest.raises(Unauthenticated):
        keys.check(Access.API, "from-yaml-0123456789")


def test_no_keys_configured_means_no_store(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("INFERGATE_API_KEYS", "INFERGATE_ADMIN_KEYS", "INFERGATE_WORKER_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    config = load_config(None)
    assert load_key_store(config.security) is None
    security = GatewaySecurity.from_settings(config.security, config.host)
    assert security.grpc_interceptors() == [] and security.ssl_context is None


def test_unreadable_or_empty_key_files_stop_the_start(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_key_store(SecuritySettings(api_key_file=str(tmp_path / "missing")))
    (tmp_path / "empty").write_text("# nothing\n")
    with pytest.raises(ConfigError, match="holds no key"):
        load_key_store(SecuritySettings(admin_key_file=str(tmp_path / "empty")))


@pytest.mark.parametrize("given", [{"tls_cert": "c.pem"}, {"tls_key": "k.pem"}, {"worker_tls_key": "k.pem"}])
def test_certificate_and_key_go_together(given: dict[str, str]) -> None:
    with pytest.raises(ConfigError, match="go together"):
        load_config(None, security=given)


def test_worker_clients_carry_the_token_to_infergate_workers_only(tmp_path: Path) -> None:
    (tmp_path / "token").write_text("s3cret-token\n")
    make = worker_client_factory(SecuritySettings(worker_token_file=str(tmp_path / "token")), stream_calls=False,
                                 packed_streams=True, worker_keepalive_s=10.0, triton_keepalive_s=310.0)
    ours = make(WorkerSpec("127.0.0.1:1"))
    triton = make(WorkerSpec("127.0.0.1:2", kind="triton", headers=(("x-h", "v"),)))
    assert ("authorization", "Bearer s3cret-token") in ours._metadata  # noqa: SLF001
    assert triton._metadata == (("x-h", "v"),)  # noqa: SLF001
    (tmp_path / "bad").write_text("two words\n")
    with pytest.raises(ConfigError):
        worker_client_factory(SecuritySettings(worker_token_file=str(tmp_path / "bad")), stream_calls=False,
                              packed_streams=True, worker_keepalive_s=10.0, triton_keepalive_s=310.0)


def test_up_makes_a_private_random_token(tmp_path: Path) -> None:
    dirs = [tmp_path / name for name in ("a", "b", "c")]
    for d in dirs:
        d.mkdir()
    first = local_worker_token(dirs[0], SecuritySettings())
    second = local_worker_token(dirs[1], SecuritySettings())
    assert first.stat().st_mode & 0o777 == 0o600
    assert len(first.read_text().strip()) >= 32 and first.read_text() != second.read_text()
    # A token from the environment is the one both sides get.
    from_env = local_worker_token(dirs[2], SecuritySettings(worker_token="from-env-token"))
    assert from_env.read_text().strip() == "from-env-token"


# ---- frontends: classification and secrets ----------------------------------------------


@pytest.mark.parametrize(
    ("path", "route_model", "want"),
    [
        ("/v2/health/live", None, (Access.OPEN, "")),
        ("/v2/health/ready", None, (Access.OPEN, "")),
        ("/v2", None, (Access.API, "")),
        ("/v2/models/stats", None, (Access.ALL_MODELS, "")),
        ("/v2/models/mlp", "mlp", (Access.MODEL, "mlp")),
        ("/v2/models/mlp/versions/1/infer", "mlp", (Access.MODEL, "mlp")),
        ("/v2/models/mlp/no/such/route", None, (Access.MODEL, "mlp")),
        ("/v2/repository/index", None, (Access.ADMIN, "")),
        ("/v2/repository/models/mlp/load", "mlp", (Access.ADMIN, "")),
        ("/metrics", None, (Access.ADMIN, "")),
        ("/dashboard", None, (Access.ADMIN, "")),
        ("/dashboard/dashboard.js", None, (Access.ADMIN, "")),
        ("/v2/cluster", None, (Access.ADMIN, "")),
        ("/v2/cluster/stats", None, (Access.ADMIN, "")),
        ("/anything/else", None, (Access.API, "")),
    ],
)
def test_http_access(path: str, route_model: str | None, want: tuple[Access, str]) -> None:
    assert http_access(path, route_model) == want


@pytest.mark.parametrize(
    ("method", "want"),
    [
        ("/grpc.health.v1.Health/Check", (Access.OPEN, None)),
        ("/inference.GRPCInferenceService/ServerLive", (Access.OPEN, None)),
        ("/inference.GRPCInferenceService/ServerReady", (Access.OPEN, None)),
        ("/inference.GRPCInferenceService/ServerMetadata", (Access.API, None)),
        ("/inference.GRPCInferenceService/ModelInfer", (Access.MODEL, "model_name")),
        ("/inference.GRPCInferenceService/ModelStreamInfer", (Access.MODEL, "model_name")),
        ("/inference.GRPCInferenceService/ModelMetadata", (Access.MODEL, "name")),
        ("/inference.GRPCInferenceService/ModelStatistics", (Access.MODEL, "name")),
        ("/inference.GRPCInferenceService/RepositoryIndex", (Access.ADMIN, None)),
        ("/inference.GRPCInferenceService/RepositoryModelLoad", (Access.ADMIN, None)),
        ("/inference.GRPCInferenceService/RepositoryModelUnload", (Access.ADMIN, None)),
        ("/other.Service/Method", (Access.API, None)),
    ],
)
def test_grpc_access(method: str, want: tuple[Access, str | None]) -> None:
    assert grpc_access(method) == want


def test_secrets_from_headers_and_metadata() -> None:
    assert http_secret(f"Bearer {FULL}") == FULL
    assert http_secret(f"bearer   {FULL} ") == FULL
    assert http_secret("Basic " + base64.b64encode(f"anyone:{ADMIN}".encode()).decode()) == ADMIN
    for bad in (None, "", FULL, "Bearer", "Basic !!!", "Token abc"):
        assert http_secret(bad) is None
    assert grpc_secret((("x", "y"), ("authorization", f"Bearer {FULL}"))) == FULL
    assert grpc_secret((("authorization", FULL),)) is None
    assert grpc_secret(None) is None


async def _ok(request: web.Request) -> web.Response:
    return web.Response(text="ok")


Middleware = Callable[..., Awaitable[web.StreamResponse]]


async def call(middleware: Middleware, path: str, **headers: str) -> web.StreamResponse:
    return await middleware(make_mocked_request("GET", path, headers=headers), _ok)


async def test_http_middleware_answers_401_with_challenges() -> None:
    middleware = http_auth_middleware(store())
    response = await call(middleware, "/v2/models/secretmodel")
    assert response.status == 401 and b"secretmodel" not in response.body
    assert response.headers.getall("WWW-Authenticate") == ['Bearer realm="infergate"']
    admin = await call(middleware, "/metrics", Authorization=f"Bearer {FULL}")
    assert admin.status == 401 and any(h.startswith("Basic") for h in admin.headers.getall("WWW-Authenticate"))
    assert (await call(middleware, "/metrics", Authorization=f"Bearer {ADMIN}")).status == 200
    assert (await call(middleware, "/v2/health/ready")).status == 200
    with pytest.raises(PermissionDenied):
        await call(middleware, "/v2/models/mlp", Authorization=f"Bearer {ONLY}")


# ---- the worker's token ------------------------------------------------------------


def test_worker_token_interceptor_allows_only_the_token() -> None:
    check = TokenInterceptor(hashlib.sha256(b"tok-123").digest())
    assert check.allows((("authorization", "Bearer tok-123"),))
    assert check.allows((("authorization", b"bearer tok-123"),))
    for metadata in ((), (("authorization", "Bearer tok-1234"),), (("authorization", "tok-123"),), None):
        assert not check.allows(metadata)


def worker_args(**values: object) -> argparse.Namespace:
    base = {"auth_token_file": None, "tls_cert": None, "tls_key": None, "tls_client_ca": None}
    return argparse.Namespace(**{**base, **values})


def test_worker_security_from_args(tmp_path: Path) -> None:
    (tmp_path / "token").write_text("tok-123\n")
    security = WorkerSecurity.from_args(worker_args(auth_token_file=tmp_path / "token"))
    assert security.token_digest == hashlib.sha256(b"tok-123").digest()
    assert "tok-123" not in repr(security) and len(security.interceptors()) == 1
    assert WorkerSecurity.from_args(worker_args()).interceptors() == []
    for bad in (
        worker_args(auth_token_file=tmp_path / "missing"),
        worker_args(tls_cert=tmp_path / "token"),
        worker_args(tls_client_ca=tmp_path / "token"),
    ):
        with pytest.raises(WorkerAuthError):
            WorkerSecurity.from_args(bad)


@pytest.mark.parametrize("size", [16, 2 * wire.SPLIT_MIN_BYTES])
def test_a_model_infer_call_is_checked_against_its_model_as_received_small_or_large(size: int) -> None:
    # ModelInfer arrives as its bytes and header (a large one with its tensors kept aside).
    request = service_pb2.ModelInferRequest(model_name="secretmodel", raw_input_contents=[b"x" * size])
    received = wire.receive_infer_request(request.SerializeToString())
    keys = store()
    _check(keys, Access.MODEL, "model_name", received, ONLY)  # its own model: allowed
    request.model_name = "mlp"
    with pytest.raises(PermissionDenied):
        _check(keys, Access.MODEL, "model_name", wire.receive_infer_request(request.SerializeToString()), ONLY)
