from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Tensor(_message.Message):
    __slots__ = ("name", "datatype", "shape", "raw")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DATATYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    RAW_FIELD_NUMBER: _ClassVar[int]
    name: str
    datatype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    raw: bytes
    def __init__(self, name: _Optional[str] = ..., datatype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., raw: _Optional[bytes] = ...) -> None: ...

class Boundary(_message.Message):
    __slots__ = ("name", "collective", "axis", "pieces")
    NAME_FIELD_NUMBER: _ClassVar[int]
    COLLECTIVE_FIELD_NUMBER: _ClassVar[int]
    AXIS_FIELD_NUMBER: _ClassVar[int]
    PIECES_FIELD_NUMBER: _ClassVar[int]
    name: str
    collective: str
    axis: int
    pieces: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, name: _Optional[str] = ..., collective: _Optional[str] = ..., axis: _Optional[int] = ..., pieces: _Optional[_Iterable[int]] = ...) -> None: ...

class Step(_message.Message):
    __slots__ = ("shard", "inputs", "outputs", "boundaries", "forward")
    SHARD_FIELD_NUMBER: _ClassVar[int]
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    BOUNDARIES_FIELD_NUMBER: _ClassVar[int]
    FORWARD_FIELD_NUMBER: _ClassVar[int]
    shard: str
    inputs: _containers.RepeatedScalarFieldContainer[str]
    outputs: _containers.RepeatedScalarFieldContainer[str]
    boundaries: _containers.RepeatedCompositeFieldContainer[Boundary]
    forward: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, shard: _Optional[str] = ..., inputs: _Optional[_Iterable[str]] = ..., outputs: _Optional[_Iterable[str]] = ..., boundaries: _Optional[_Iterable[_Union[Boundary, _Mapping]]] = ..., forward: _Optional[_Iterable[str]] = ...) -> None: ...

class SetupGroupRequest(_message.Message):
    __slots__ = ("group_id", "epoch", "rank", "peers", "kind", "steps")
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    PEERS_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    group_id: str
    epoch: int
    rank: int
    peers: _containers.RepeatedScalarFieldContainer[str]
    kind: str
    steps: _containers.RepeatedCompositeFieldContainer[Step]
    def __init__(self, group_id: _Optional[str] = ..., epoch: _Optional[int] = ..., rank: _Optional[int] = ..., peers: _Optional[_Iterable[str]] = ..., kind: _Optional[str] = ..., steps: _Optional[_Iterable[_Union[Step, _Mapping]]] = ...) -> None: ...

class SetupGroupResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TeardownGroupRequest(_message.Message):
    __slots__ = ("group_id", "epoch")
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    group_id: str
    epoch: int
    def __init__(self, group_id: _Optional[str] = ..., epoch: _Optional[int] = ...) -> None: ...

class TeardownGroupResponse(_message.Message):
    __slots__ = ("known",)
    KNOWN_FIELD_NUMBER: _ClassVar[int]
    known: bool
    def __init__(self, known: _Optional[bool] = ...) -> None: ...

class RunRequest(_message.Message):
    __slots__ = ("group_id", "epoch", "batch_id", "inputs", "outputs", "rank")
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    group_id: str
    epoch: int
    batch_id: int
    inputs: _containers.RepeatedCompositeFieldContainer[Tensor]
    outputs: _containers.RepeatedScalarFieldContainer[str]
    rank: int
    def __init__(self, group_id: _Optional[str] = ..., epoch: _Optional[int] = ..., batch_id: _Optional[int] = ..., inputs: _Optional[_Iterable[_Union[Tensor, _Mapping]]] = ..., outputs: _Optional[_Iterable[str]] = ..., rank: _Optional[int] = ...) -> None: ...

class RunResponse(_message.Message):
    __slots__ = ("outputs", "peer_bytes")
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    PEER_BYTES_FIELD_NUMBER: _ClassVar[int]
    outputs: _containers.RepeatedCompositeFieldContainer[Tensor]
    peer_bytes: int
    def __init__(self, outputs: _Optional[_Iterable[_Union[Tensor, _Mapping]]] = ..., peer_bytes: _Optional[int] = ...) -> None: ...

class PeerMessage(_message.Message):
    __slots__ = ("group_id", "epoch", "batch_id", "step", "source_rank", "tensor", "target_rank", "part")
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    SOURCE_RANK_FIELD_NUMBER: _ClassVar[int]
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    TARGET_RANK_FIELD_NUMBER: _ClassVar[int]
    PART_FIELD_NUMBER: _ClassVar[int]
    group_id: str
    epoch: int
    batch_id: int
    step: int
    source_rank: int
    tensor: Tensor
    target_rank: int
    part: int
    def __init__(self, group_id: _Optional[str] = ..., epoch: _Optional[int] = ..., batch_id: _Optional[int] = ..., step: _Optional[int] = ..., source_rank: _Optional[int] = ..., tensor: _Optional[_Union[Tensor, _Mapping]] = ..., target_rank: _Optional[int] = ..., part: _Optional[int] = ...) -> None: ...

class ExchangeResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
