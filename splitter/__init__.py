"""The splitter: offline model splitting, used by ``infergate split`` (``cli``)
and by the gateway when it loads a logical model.

Static graph facts (``graph``), symbolic shapes (``shapes``), declared
inputs and size plans (``sizes``), probing at concrete sizes (``probe``),
tensor-parallel rules by dataflow (``tensor*``, ``layout``), pipeline cuts
balanced by weight bytes (``pipeline``), both composed (``layout_split``),
the plan format (``plan``), shard files (``shards``), a reference executor
(``execute``) and verification against the unsplit model (``verify``).

May import: ``protos``, onnx and onnxruntime; never ``gateway`` or
``workers``: it runs with no server.

Public API::

    split_tensor_parallel(model, n, *, name, strict=False, hints=None, declared=None) -> SplitResult
    split_pipeline_parallel(model, m, *, name, hints=None, declared=None) -> SplitResult
    InputHints(shapes={name: dims}, values={name: array})  # --input-shape / --input-values
    SplitResult.plan: Plan; SplitResult.models: {shard name: ModelProto}
    Plan.to_json() / Plan.from_json(text)
    write_split(result, directory) / load_split(directory); shard_config(shard)
    PlanExecutor(plan, run_shard).run(inputs)  # run_shard: async (Shard, feeds) -> outputs
    LocalShards, run_plan(plan, models, inputs), verify_split(model, result)
"""

from splitter.execute import LocalShards, PlanExecutor, ShardRunner, run_plan
from splitter.graph import SplitError
from splitter.pipeline import split_pipeline_parallel
from splitter.plan import Boundary, Collective, Fallback, Plan, Segment, Shard, TensorSpec
from splitter.shards import SplitResult, load_split, shard_config, write_split
from splitter.sizes import InputHints
from splitter.tensor import split_tensor_parallel
from splitter.verify import VerifyReport, verify_split

__all__ = [
    "Boundary",
    "Collective",
    "Fallback",
    "InputHints",
    "LocalShards",
    "Plan",
    "PlanExecutor",
    "Segment",
    "Shard",
    "ShardRunner",
    "SplitError",
    "SplitResult",
    "TensorSpec",
    "VerifyReport",
    "load_split",
    "run_plan",
    "shard_config",
    "split_pipeline_parallel",
    "split_tensor_parallel",
    "verify_split",
    "write_split",
]
