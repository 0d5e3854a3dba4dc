"""The JSON bodies of the REST management endpoints, in Triton's shape.

Owns the mapping between protobuf messages (metadata, config, statistics,
repository index) and Triton's REST JSON: snake_case field names and 64-bit
integers as JSON numbers; the parsing of repository load/unload bodies into
gRPC repository parameters; and the per-worker statistics section
(``?workers=true``). Nothing here touches aiohttp: ``gateway.frontends.http_api``
reads the requests and sends these bodies. The inference body format lives in
``gateway.frontends.http_codec``.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Mapping
from typing import Any

import orjson
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message
from tritonclient.grpc import service_pb2

from protos.errors import InvalidArgument

_INT64_TYPES = frozenset(
    {
        FieldDescriptor.TYPE_INT64,
        FieldDescriptor.TYPE_UINT64,
        FieldDescriptor.TYPE_SINT64,
        FieldDescriptor.TYPE_FIXED64,
        FieldDescriptor.TYPE_SFIXED64,
    }
)


def message_to_json(message: Message, *, include_unset_messages: bool = False) -> dict[str, Any]:
    """A protobuf message as Triton's REST JSON.

    Like protobuf's JSON with preserved field names and fields without
    presence always printed, except that 64-bit integers stay JSON numbers
    (Triton's REST API and tritonclient expect ``"dims": [4]``, not
    ``["4"]``). ``include_unset_messages`` also prints unset sub-messages
    with their defaults (statistics, where Triton always prints every field);
    never use it for a ModelConfig, where a message's presence has meaning.
    """
    out: dict[str, Any] = {}
    for field in message.DESCRIPTOR.fields:
        if field.has_presence and not field.is_repeated and not message.HasField(field.name):
            if not (include_unset_messages and field.message_type is not None
                    and field.containing_oneof is None):
                continue
        value = getattr(message, field.name)
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            value_field = field.message_type.fields_by_name["value"]
            out[field.name] = {str(k): _field_value(value_field, v, include_unset_messages) for k, v in value.items()}
        elif field.is_repeated:
            out[field.name] = [_field_value(field, v, include_unset_messages) for v in value]
        else:
            out[field.name] = _field_value(field, value, include_unset_messages)
    return out


def _field_value(field: FieldDescriptor, value: Any, include_unset: bool) -> Any:
    if field.type == FieldDescriptor.TYPE_MESSAGE:
        return message_to_json(value, include_unset_messages=include_unset)
    if field.type == FieldDescriptor.TYPE_ENUM:
        enum_value = field.enum_type.values_by_number.get(value)
        return enum_value.name if enum_value is not None else value
    if field.type == FieldDescriptor.TYPE_BYTES:
        return base64.b64encode(value).decode("ascii")
    if field.type in _INT64_TYPES:
        return int(value)
    return value


def repository_index_to_json(index: service_pb2.RepositoryIndexResponse) -> list[dict[str, str]]:
    """Triton's REST repository index: a list of {name, version?, state?, reason?}."""
    models: list[dict[str, str]] = []
    for entry in index.models:
        item = {"name": entry.name}
        for key in ("version", "state", "reason"):
            value = getattr(entry, key)
            if value:
                item[key] = value
        models.append(item)
    return models


def load_parameters(doc: Mapping[str, Any]) -> dict[str, service_pb2.ModelRepositoryParameter]:
    """The ``parameters`` of a repository load body as gRPC repository parameters.

    ``config`` stays a JSON string; ``file:<path>`` values are base64 and
    become bytes, as in Triton's REST API.
    """
    raw = doc.get("parameters")
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise InvalidArgument(f"load request: 'parameters' must be an object, got {type(raw).__name__}")
    params: dict[str, service_pb2.ModelRepositoryParameter] = {}
    for key, value in raw.items():
        params[key] = _load_parameter(key, value)
    return params


def _load_parameter(key: str, value: Any) -> service_pb2.ModelRepositoryParameter:
    param = service_pb2.ModelRepositoryParameter()
    try:
        if key.startswith("file:"):
            if not isinstance(value, str):
                raise InvalidArgument(f"load parameter '{key}' must be a base64 string")
            param.bytes_param = base64.b64decode(value, validate=True)
        elif key == "config":
            if not isinstance(value, str):
                raise InvalidArgument("load parameter 'config' must be a string holding the model config as JSON")
            param.string_param = value
        elif isinstance(value, bool):
            param.bool_param = value
        elif isinstance(value, int):
            param.int64_param = value
        elif isinstance(value, str):
            param.string_param = value
        else:
            raise InvalidArgument(f"load parameter '{key}' must be a string, integer or boolean")
    except binascii.Error:
        raise InvalidArgument(f"load parameter '{key}' is not valid base64") from None
    except ValueError:  # an integer beyond int64
        raise InvalidArgument(f"load parameter '{key}' is out of range") from None
    return param


INDEX_READY_MESSAGE = "Invalid value for 'ready': expected a boolean"


def index_ready(body: bytes | bytearray | memoryview) -> bool:
    """The ``ready`` flag of a ``/v2/repository/index`` body (False when empty), in Triton's words.

    Triton's parser takes a body nested deeper than orjson's 1024 levels and
    only then finds that ``ready`` is not a boolean; such a body is answered
    with the same words here.
    """
    if memoryview(body).nbytes == 0:
        return False
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        if str(exc).startswith("depth limit exceeded"):
            raise InvalidArgument(INDEX_READY_MESSAGE) from None
        raise InvalidArgument(f"repository index request: malformed JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise InvalidArgument("repository index request: expected a JSON object")
    ready = doc.get("ready", False)
    if not isinstance(ready, bool):
        raise InvalidArgument(INDEX_READY_MESSAGE)
    return ready


def bool_field(doc: Mapping[str, Any], key: str, what: str) -> bool:
    value = doc.get(key, False)
    if not isinstance(value, bool):
        raise InvalidArgument(f"{what}: '{key}' must be true or false, got {value!r}")
    return value


def worker_statistics_json(worker: Any) -> dict[str, Any]:
    """One ``gateway.fleet.repository.WorkerStatistics`` as JSON: Triton's ``model_stats`` or an ``error``."""
    out: dict[str, Any] = {
        "address": worker.address,
        "kind": worker.kind,
        "state": worker.state,
        "model_control": worker.model_control,
    }
    if worker.statistics is not None:
        out["model_stats"] = message_to_json(worker.statistics, include_unset_messages=True).get("model_stats", [])
    if worker.error:
        out["error"] = worker.error
    if worker.unreadable:
        out["unreadable"] = dict(worker.unreadable)
    return out
