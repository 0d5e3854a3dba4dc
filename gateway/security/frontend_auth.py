"""Where the gateway's frontends enforce ``gateway.security.api_keys``: an aiohttp
middleware and a grpc.aio server interceptor.

Each classifies the call (health open; metrics, dashboard, cluster and
repository control need the admin key; model calls need a key that may use
the model; everything else any valid key), reads the secret (HTTP
``Authorization: Bearer KEY``, or ``Basic`` with the key as the password so
a browser can open the dashboard; gRPC metadata ``authorization: Bearer
KEY``) and asks :meth:`KeyStore.check`. A refused call never reaches
routing or the core, so its answer says nothing about the models.
"""

from __future__ import annotations

import base64
import binascii
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from aiohttp import hdrs, web

from gateway.frontends.http_errors import error_response
from gateway.frontends.openai_api import MODEL_ACCESS
from gateway.frontends.openai_errors import OPENAI_PREFIX, openai_error_response
from gateway.security.api_keys import Access, ApiKey, KeyStore
from protos.errors import InferGateError, Unauthenticated, retry_metadata

log = logging.getLogger(__name__)

_Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

# ---- HTTP ------------------------------------------------------------------------------

_OPEN_PATHS = frozenset({"/v2/health/live", "/v2/health/ready"})
_ADMIN_EXACT = frozenset({"/metrics", "/dashboard", "/v2/cluster", "/v2/repository"})
_ADMIN_PREFIXES = ("/dashboard/", "/v2/cluster/", "/v2/repository/")
_MODELS_PREFIX = "/v2/models/"
_BEARER_CHALLENGE = 'Bearer realm="infergate"'
# Browsers answer a Basic challenge with a login prompt, then resend the
# credentials on the dashboard's own requests to this realm.
_BASIC_CHALLENGE = 'Basic realm="infergate admin", charset="UTF-8"'


def http_access(path: str, model_in_route: str | None) -> tuple[Access, str]:
    """What a request to ``path`` needs, and the model it names ("" for none)."""
    if path in _OPEN_PATHS:
        return Access.OPEN, ""
    if path in _ADMIN_EXACT or path.startswith(_ADMIN_PREFIXES):
        return Access.ADMIN, ""
    if path == "/v2/models/stats":
        return Access.ALL_MODELS, ""
    if path.startswith(_MODELS_PREFIX):
        # The route's own match when there is one; for paths no route matches
        # (answered 404 after this check) the segment after /v2/models/.
        model = model_in_route if model_in_route is not None else path[len(_MODELS_PREFIX):].split("/", 1)[0]
        return Access.MODEL, model
    return Access.API, ""


def http_secret(authorization: str | None) -> str | None:
    """The key in an ``Authorization`` header: ``Bearer KEY``, or ``Basic`` with KEY as the password."""
    if not authorization:
        return None
    scheme, _, value = authorization.strip().partition(" ")
    value = value.strip()
    if scheme.lower() == "bearer":
        return value or None
    if scheme.lower() == "basic":
        try:
            decoded = base64.b64decode(value, validate=True).decode("utf-8")
        except (binascii.Error, UnicodeDecodeError):
            return None
        _, sep, password = decoded.partition(":")
        return password if sep and password else None
    return None


def http_auth_middleware(store: KeyStore) -> Callable[[web.Request, _Handler], Awaitable[web.StreamResponse]]:
    """The middleware to append to the app's list, after (inside) the error middleware.

    401 answers are written here to carry ``WWW-Authenticate``; 403 and 429
    are raised for the error middleware to answer, as every other error.
    """

    @web.middleware
    async def auth_middleware(request: web.Request, handler: _Handler) -> web.StreamResponse:
        access, model = http_access(request.path, request.match_info.get("model"))
        secret = http_secret(request.headers.get(hdrs.AUTHORIZATION))
        openai = request.path.startswith(OPENAI_PREFIX)
        try:
            if openai and store.api_keys_enabled:
                # The model is in the body: who now, what and how often once the handler has read it.
                request[MODEL_ACCESS] = _OpenAIAccess(store, store.authenticate(secret), secret,
                                                      charge=request.method != "GET")
            if not openai or request.method == "GET":
                store.check(access, secret, model)
        except Unauthenticated as exc:
            log.debug("%s %s refused: %s", request.method, request.path, exc.message)
            if openai:
                response = openai_error_response(exc.http_status, exc.message)
                response.headers.add(hdrs.WWW_AUTHENTICATE, _BEARER_CHALLENGE)
                return response
            response = error_response(exc.http_status, exc.message)
            if access is Access.ADMIN:
                response.headers.add(hdrs.WWW_AUTHENTICATE, _BASIC_CHALLENGE)
            response.headers.add(hdrs.WWW_AUTHENTICATE, _BEARER_CHALLENGE)
            return response
        return await handler(request)

    return auth_middleware


class _OpenAIAccess:
    """What an authenticated key may do on the OpenAI API (``gateway.frontends.openai_api.ModelAccess``)."""

    def __init__(self, store: KeyStore, key: ApiKey, secret: str | None, *, charge: bool) -> None:
        self._store = store
        self._key = key
        self._secret = secret
        self._charge = charge

    def check(self, model: str) -> None:
        if self._charge:
            self._store.check(Access.MODEL, self._secret, model)
        elif not self._key.may_use(model):
            self._store.check(Access.MODEL, self._secret, model)  # raises PermissionDenied

    def may_see(self, model: str) -> bool:
        return self._key.may_use(model)


# ---- gRPC ------------------------------------------------------------------------------

_SERVICE = "/inference.GRPCInferenceService/"
_HEALTH = "/grpc.health.v1.Health/"
_MEMBERSHIP = "/infergate.cluster.v1.ClusterMembership/"
_OPEN_METHODS = frozenset({"ServerLive", "ServerReady"})
_ADMIN_METHODS = frozenset({"RepositoryIndex", "RepositoryModelLoad", "RepositoryModelUnload"})
# Method -> the request field that names its model.
_MODEL_FIELDS = {
    "ModelInfer": "model_name",
    "ModelStreamInfer": "model_name",
    "ModelMetadata": "name",
    "ModelConfig": "name",
    "ModelReady": "name",
    "ModelStatistics": "name",
}


def grpc_access(method: str) -> tuple[Access, str | None]:
    """What a call of ``method`` (``/package.Service/Method``) needs, and the
    request field naming its model (None when it names none)."""
    if method.startswith(_HEALTH):
        return Access.OPEN, None
    if method.startswith(_MEMBERSHIP):
        # Workers registering: the registry checks the worker token itself.
        return Access.OPEN, None
    if not method.startswith(_SERVICE):
        return Access.API, None
    name = method[len(_SERVICE):]
    if name in _OPEN_METHODS:
        return Access.OPEN, None
    if name in _ADMIN_METHODS:
        return Access.ADMIN, None
    if name in _MODEL_FIELDS:
        return Access.MODEL, _MODEL_FIELDS[name]
    return Access.API, None


def grpc_secret(metadata: Any) -> str | None:
    for key, value in metadata or ():
        if key == "authorization":
            text = value.decode("utf-8", "replace") if isinstance(value, bytes) else value
            scheme, _, secret = text.strip().partition(" ")
            return (secret.strip() or None) if scheme.lower() == "bearer" else None
    return None


def _check(store: KeyStore, access: Access, model_field: str | None, request: Any, secret: str | None) -> None:
    if model_field is None:
        store.check(access, secret)
        return
    # ModelInfer arrives as its bytes and header (protos.wire: ReceivedInferRequest, RawInferRequest).
    model = getattr(getattr(request, "header", request), model_field, "")
    # Statistics without a model name answer for every model.
    store.check(Access.MODEL if model else Access.ALL_MODELS, secret, model)


async def _abort(context: grpc.aio.ServicerContext, err: InferGateError) -> None:
    await context.abort(err.grpc_code, err.message, trailing_metadata=retry_metadata(err))


class GrpcAuthInterceptor(grpc.aio.ServerInterceptor):
    """Checks every call before its handler runs; streams are checked per message.

    A stream is refused as a whole (UNAUTHENTICATED) before its first message
    without a valid key; a later message for a model the key may not use, or
    beyond its quota, ends the stream with that status.
    """

    def __init__(self, store: KeyStore) -> None:
        self._store = store

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler | None]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(details)
        access, model_field = grpc_access(details.method)
        if handler is None or access is Access.OPEN:
            return handler
        secret = grpc_secret(details.invocation_metadata)
        store = self._store
        if handler.unary_unary is not None:
            inner = handler.unary_unary

            async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
                try:
                    _check(store, access, model_field, request, secret)
                except InferGateError as err:
                    await _abort(context, err)
                return await inner(request, context)

            return handler._replace(unary_unary=unary)
        if handler.stream_stream is not None:
            return handler._replace(stream_stream=self._stream(handler.stream_stream, access, model_field, secret))
        # No other shapes in the services served; refuse rather than pass unchecked.
        log.warning("gRPC method %s has a handler shape the auth check does not cover: refused", details.method)
        return _refusing(handler)

    def _stream(
        self, inner: Callable[..., AsyncIterator[Any]], access: Access, model_field: str | None, secret: str | None
    ) -> Callable[[AsyncIterator[Any], grpc.aio.ServicerContext], AsyncIterator[Any]]:
        store = self._store

        async def stream(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            try:
                # Who, before reading anything; what and how often, per message.
                if store.api_keys_enabled:
                    store.authenticate(secret)
                if model_field is None:
                    store.check(access, secret)
            except InferGateError as err:
                await _abort(context, err)

            async def checked() -> AsyncIterator[Any]:
                async for request in requests:
                    if model_field is not None:
                        # An error here ends the servicer's stream with its status.
                        _check(store, access, model_field, request, secret)
                    yield request

            async for response in inner(checked(), context):
                yield response

        return stream


def _refusing(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    async def refuse(request: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.PERMISSION_DENIED, "this call is not available")

    if handler.unary_stream is not None:
        return handler._replace(unary_stream=refuse)
    return handler._replace(stream_unary=refuse)
