"""The KServe v2 answers a model manager gives, as protobuf messages, for
whoever serves it: the worker's gRPC service and the gateway's local replica
answer alike because both answer from here.

``model_metadata``: a model's metadata (its versions, platform, tensors);
``load_arguments``: a load request's override parameters (``config`` and
``file:<path>``) read and checked; ``as_error``: any exception as the
``protos.errors`` class a caller is answered with (an unexpected one logged
with its traceback, and answered INTERNAL naming it, its message cleaned of
paths).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from tritonclient.grpc import service_pb2

from execution.backends.run_errors import clean_message
from execution.manager import ModelManager
from protos.errors import InferGateError, Internal, InvalidArgument

logger = logging.getLogger(__name__)


def model_metadata(manager: ModelManager, name: str, version: str = "") -> service_pb2.ModelMetadataResponse:
    model = manager.get(name, version)
    sig = model.signature
    if version:
        versions = [model.version_str]
    else:
        versions = [str(v) for v in sorted(m.version for m in manager.loaded() if m.name == model.name)]
    # A backend model (Python) has no platform: Triton reports its backend there.
    platform = model.config.platform or model.config.backend
    response = service_pb2.ModelMetadataResponse(name=model.name, versions=versions, platform=platform)
    for spec in sig.inputs.values():
        response.inputs.add(name=spec.name, datatype=spec.datatype, shape=sig.full_shape(spec))
    for spec in sig.outputs.values():
        response.outputs.add(name=spec.name, datatype=spec.datatype, shape=sig.full_shape(spec))
    return response


def load_arguments(
    parameters: Mapping[str, service_pb2.ModelRepositoryParameter],
) -> tuple[str | None, dict[str, bytes]]:
    """(config JSON or None, files by path) of a load request's parameters."""
    config_json: str | None = None
    files: dict[str, bytes] = {}
    for key, param in parameters.items():
        kind = param.WhichOneof("parameter_choice")
        if key == "config":
            if kind != "string_param":
                raise InvalidArgument("load parameter 'config' must be a string holding the model config as JSON")
            config_json = param.string_param
        elif key.startswith("file:"):
            if kind != "bytes_param":
                raise InvalidArgument(f"load parameter '{key}' must carry the file's bytes")
            files[key.removeprefix("file:")] = param.bytes_param
    return config_json, files


def as_error(exc: Exception, what: str, where: str = "the worker") -> InferGateError:
    if isinstance(exc, InferGateError):
        return exc
    logger.exception("unexpected error in %s", what)
    cause = clean_message(str(exc).splitlines()[0] if str(exc) else "")
    return Internal(f"{what} failed on {where}: {type(exc).__name__}{': ' + cause if cause else ''}")
