from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Device(_message.Message):
    __slots__ = ("kind", "index", "name", "uuid", "memory_total_bytes", "memory_free_bytes")
    KIND_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    UUID_FIELD_NUMBER: _ClassVar[int]
    MEMORY_TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_FREE_BYTES_FIELD_NUMBER: _ClassVar[int]
    kind: str
    index: int
    name: str
    uuid: str
    memory_total_bytes: int
    memory_free_bytes: int
    def __init__(self, kind: _Optional[str] = ..., index: _Optional[int] = ..., name: _Optional[str] = ..., uuid: _Optional[str] = ..., memory_total_bytes: _Optional[int] = ..., memory_free_bytes: _Optional[int] = ...) -> None: ...

class ModelLoad(_message.Message):
    __slots__ = ("name", "versions", "memory_bytes", "estimated_bytes", "measured_bytes", "measured_on", "inflight", "queued", "rows_per_s", "last_inference_ms")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    ESTIMATED_BYTES_FIELD_NUMBER: _ClassVar[int]
    MEASURED_BYTES_FIELD_NUMBER: _ClassVar[int]
    MEASURED_ON_FIELD_NUMBER: _ClassVar[int]
    INFLIGHT_FIELD_NUMBER: _ClassVar[int]
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    ROWS_PER_S_FIELD_NUMBER: _ClassVar[int]
    LAST_INFERENCE_MS_FIELD_NUMBER: _ClassVar[int]
    name: str
    versions: _containers.RepeatedScalarFieldContainer[str]
    memory_bytes: int
    estimated_bytes: int
    measured_bytes: int
    measured_on: str
    inflight: int
    queued: int
    rows_per_s: float
    last_inference_ms: int
    def __init__(self, name: _Optional[str] = ..., versions: _Optional[_Iterable[str]] = ..., memory_bytes: _Optional[int] = ..., estimated_bytes: _Optional[int] = ..., measured_bytes: _Optional[int] = ..., measured_on: _Optional[str] = ..., inflight: _Optional[int] = ..., queued: _Optional[int] = ..., rows_per_s: _Optional[float] = ..., last_inference_ms: _Optional[int] = ...) -> None: ...

class WorkerLoad(_message.Message):
    __slots__ = ("inflight", "queued", "rows_per_s", "models")
    INFLIGHT_FIELD_NUMBER: _ClassVar[int]
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    ROWS_PER_S_FIELD_NUMBER: _ClassVar[int]
    MODELS_FIELD_NUMBER: _ClassVar[int]
    inflight: int
    queued: int
    rows_per_s: float
    models: _containers.RepeatedCompositeFieldContainer[ModelLoad]
    def __init__(self, inflight: _Optional[int] = ..., queued: _Optional[int] = ..., rows_per_s: _Optional[float] = ..., models: _Optional[_Iterable[_Union[ModelLoad, _Mapping]]] = ...) -> None: ...

class RegisterRequest(_message.Message):
    __slots__ = ("address", "worker_id", "backend", "devices", "load", "metrics_port", "version")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    METRICS_PORT_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    address: str
    worker_id: str
    backend: str
    devices: _containers.RepeatedCompositeFieldContainer[Device]
    load: WorkerLoad
    metrics_port: int
    version: str
    def __init__(self, address: _Optional[str] = ..., worker_id: _Optional[str] = ..., backend: _Optional[str] = ..., devices: _Optional[_Iterable[_Union[Device, _Mapping]]] = ..., load: _Optional[_Union[WorkerLoad, _Mapping]] = ..., metrics_port: _Optional[int] = ..., version: _Optional[str] = ...) -> None: ...

class RegisterResponse(_message.Message):
    __slots__ = ("heartbeat_interval_s", "gateway_id")
    HEARTBEAT_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    GATEWAY_ID_FIELD_NUMBER: _ClassVar[int]
    heartbeat_interval_s: float
    gateway_id: str
    def __init__(self, heartbeat_interval_s: _Optional[float] = ..., gateway_id: _Optional[str] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("address", "worker_id", "devices", "load")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    address: str
    worker_id: str
    devices: _containers.RepeatedCompositeFieldContainer[Device]
    load: WorkerLoad
    def __init__(self, address: _Optional[str] = ..., worker_id: _Optional[str] = ..., devices: _Optional[_Iterable[_Union[Device, _Mapping]]] = ..., load: _Optional[_Union[WorkerLoad, _Mapping]] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("known", "draining", "heartbeat_interval_s")
    KNOWN_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    known: bool
    draining: bool
    heartbeat_interval_s: float
    def __init__(self, known: _Optional[bool] = ..., draining: _Optional[bool] = ..., heartbeat_interval_s: _Optional[float] = ...) -> None: ...

class DeregisterRequest(_message.Message):
    __slots__ = ("address", "worker_id")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    address: str
    worker_id: str
    def __init__(self, address: _Optional[str] = ..., worker_id: _Optional[str] = ...) -> None: ...

class DeregisterResponse(_message.Message):
    __slots__ = ("known",)
    KNOWN_FIELD_NUMBER: _ClassVar[int]
    known: bool
    def __init__(self, known: _Optional[bool] = ...) -> None: ...
