"""Split plans: the record of how one ONNX model was cut into shard models,
and the JSON form (``plan.json``) the gateway loads to serve it.

A plan is a list of segments run in order. Each segment has one shard per
rank (tensor parallel: N shards; pipeline parallel: one). Running a plan:

* a *shared* store starts with the model's inputs; each rank also has a
  *local* store, empty at first;
* for each segment, every rank's shard gets its inputs by name, from its
  local store first, then from the shared store; its outputs go to its local
  store;
* then the segment's boundaries are applied, in order:

  - ``allreduce_sum``: the ranks' copies are summed into the shared store;
  - ``allgather``: the ranks' copies are concatenated along ``axis`` into the
    shared store (with ``pieces``, each rank holds its block of every piece,
    see :func:`gather_pieces`);
  - ``none``: the ranks already agree (or there is one rank); rank 0's copy
    goes to the shared store, so a remote runner need only fetch it from
    rank 0. With ``per_rank`` the tensor instead stays in each rank's local
    store, because a later segment consumes each rank's own (sharded or
    partial) value;

* the model's outputs are read from the shared store at the end.

Tensor names keep the meaning they have in the unsplit model: after its
collective a tensor holds exactly the unsplit model's value.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Literal

import orjson

from protos.collective_tensors import gather_pieces  # noqa: F401 - re-exported: part of the plan format

PLAN_FORMAT = 1

PlanKind = Literal["tensor", "pipeline"]


class Collective(str, enum.Enum):
    NONE = "none"
    ALLREDUCE_SUM = "allreduce_sum"
    ALLGATHER = "allgather"

@dataclass(frozen=True, slots=True)
class TensorSpec:
    """A shard or model input/output; ``shape`` uses -1 for dynamic dims."""

    name: str
    datatype: str  # KServe datatype: "FP32", "INT64", ...
    shape: tuple[int, ...]

@dataclass(frozen=True, slots=True)
class Shard:
    """One ordinary ONNX model: the part of ``segment`` that ``rank`` runs."""

    name: str  # also the model name a worker serves it under
    rank: int
    segment: int
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    weight_bytes: int
    path: str  # model file, relative to the plan's directory

@dataclass(frozen=True, slots=True)
class Boundary:
    """A tensor crossing the cut after a segment and how ranks' copies join."""

    name: str
    collective: Collective
    axis: int | None = None  # allgather only
    # allgather only: full sizes of the fused pieces laid out along ``axis``
    # (e.g. Q, K, V); empty when the axis is one plain block per rank.
    pieces: tuple[int, ...] = ()
    per_rank: bool = False  # collective none only

@dataclass(frozen=True, slots=True)
class Segment:
    index: int
    shards: tuple[Shard, ...]  # in rank order
    boundaries: tuple[Boundary, ...]

@dataclass(frozen=True, slots=True)
class Fallback:
    """A node the splitter could not shard and ran replicated instead."""

    node: str
    op_type: str
    reason: str

@dataclass(frozen=True, slots=True)
class Plan:
    model: str
    kind: PlanKind
    tensor_parallel: int
    pipeline_parallel: int
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    segments: tuple[Segment, ...]
    source_weight_bytes: int  # weight bytes of the unsplit model
    fallbacks: tuple[Fallback, ...] = field(default=())
    format: int = PLAN_FORMAT

    @property
    def ranks(self) -> int:
        return max(len(s.shards) for s in self.segments)

    def shards(self) -> list[Shard]:
        return [shard for segment in self.segments for shard in segment.shards]

    def shard(self, name: str) -> Shard:
        for shard in self.shards():
            if shard.name == name:
                return shard
        raise KeyError(name)

    def weight_shares(self) -> dict[str, float]:
        """Each shard's weight bytes as a fraction of the unsplit model's."""
        total = max(self.source_weight_bytes, 1)
        return {s.name: s.weight_bytes / total for s in self.shards()}

    def rank_shares(self) -> list[float]:
        """Tensor parallel: each rank's weight bytes (all segments) over the unsplit model's."""
        total = max(self.source_weight_bytes, 1)
        per_rank = [0] * self.ranks
        for shard in self.shards():
            per_rank[shard.rank] += shard.weight_bytes
        return [b / total for b in per_rank]

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": self.format,
            "model": self.model,
            "kind": self.kind,
            "tensor_parallel": self.tensor_parallel,
            "pipeline_parallel": self.pipeline_parallel,
            "source_weight_bytes": self.source_weight_bytes,
            "inputs": [_spec_to_dict(t) for t in self.inputs],
            "outputs": [_spec_to_dict(t) for t in self.outputs],
            "segments": [
                {
                    "index": seg.index,
                    "shards": [
                        {
                            "name": sh.name,
                            "rank": sh.rank,
                            "segment": sh.segment,
                            "path": sh.path,
                            "weight_bytes": sh.weight_bytes,
                            "inputs": [_spec_to_dict(t) for t in sh.inputs],
                            "outputs": [_spec_to_dict(t) for t in sh.outputs],
                        }
                        for sh in seg.shards
                    ],
                    "boundaries": [_boundary_to_dict(b) for b in seg.boundaries],
                }
                for seg in self.segments
            ],
            "fallbacks": [{"node": f.node, "op_type": f.op_type, "reason": f.reason} for f in self.fallbacks],
        }

    def to_json(self) -> str:
        return orjson.dumps(self.to_dict(), option=orjson.OPT_INDENT_2).decode()

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Plan:
        if data.get("format") != PLAN_FORMAT:
            raise ValueError(f"unsupported plan format {data.get('format')!r} (expected {PLAN_FORMAT})")
        segments = tuple(
            Segment(
                index=int(seg["index"]),
                shards=tuple(
                    Shard(
                        name=sh["name"],
                        rank=int(sh["rank"]),
                        segment=int(sh["segment"]),
                        path=sh["path"],
                        weight_bytes=int(sh["weight_bytes"]),
                        inputs=tuple(_spec_from_dict(t) for t in sh["inputs"]),
                        outputs=tuple(_spec_from_dict(t) for t in sh["outputs"]),
                    )
                    for sh in seg["shards"]
                ),
                boundaries=tuple(_boundary_from_dict(b) for b in seg["boundaries"]),
            )
            for seg in data["segments"]
        )
        return cls(
            model=data["model"],
            kind=data["kind"],
            tensor_parallel=int(data["tensor_parallel"]),
            pipeline_parallel=int(data["pipeline_parallel"]),
            inputs=tuple(_spec_from_dict(t) for t in data["inputs"]),
            outputs=tuple(_spec_from_dict(t) for t in data["outputs"]),
            segments=segments,
            source_weight_bytes=int(data["source_weight_bytes"]),
            fallbacks=tuple(Fallback(f["node"], f["op_type"], f["reason"]) for f in data.get("fallbacks", ())),
        )

    @classmethod
    def from_json(cls, text: str | bytes) -> Plan:
        return cls.from_dict(orjson.loads(text))

def shard_name(model: str, kind: PlanKind, degree: int, rank: int, segment: int) -> str:
    """``<model>.tp2.r0.s1`` (tensor parallel) or ``<model>.pp3.s1`` (pipeline)."""
    if kind == "tensor":
        return f"{model}.tp{degree}.r{rank}.s{segment}"
    return f"{model}.pp{degree}.s{segment}"

def _spec_to_dict(spec: TensorSpec) -> dict[str, Any]:
    return {"name": spec.name, "datatype": spec.datatype, "shape": list(spec.shape)}

def _spec_from_dict(data: dict[str, Any]) -> TensorSpec:
    return TensorSpec(name=data["name"], datatype=data["datatype"], shape=tuple(int(d) for d in data["shape"]))

def _boundary_to_dict(b: Boundary) -> dict[str, Any]:
    out: dict[str, Any] = {"name": b.name, "collective": b.collective.value}
    if b.collective is Collective.ALLGATHER:
        out["axis"] = b.axis
        if b.pieces:
            out["pieces"] = list(b.pieces)
    if b.per_rank:
        out["per_rank"] = True
    return out

def _boundary_from_dict(data: dict[str, Any]) -> Boundary:
    axis = data.get("axis")
    return Boundary(
        name=data["name"],
        collective=Collective(data["collective"]),
        axis=None if axis is None else int(axis),
        pieces=tuple(int(p) for p in data.get("pieces", ())),
        per_rank=bool(data.get("per_rank", False)),
    )
