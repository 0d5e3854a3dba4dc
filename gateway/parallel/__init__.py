"""Model parallelism: split one ONNX model into shard models (tensor
parallel by dataflow, pipeline parallel by balanced cuts), the plan that
records how they join, and an executor that runs a plan.

Public API::

    split_tensor_parallel(model, n, *, name, strict=False) -> SplitResult
    split_pipeline_parallel(model, m, *, name) -> SplitResult
    SplitResult.plan: Plan; SplitResult.models: {shard name: ModelProto}
    Plan.to_json() / Plan.from_json(text)
    write_split(result, directory) / load_split(directory); shard_config(shard)
    PlanExecutor(plan, run_shard).run(inputs)  # run_shard: async (Shard, feeds) -> outputs
    LocalShards, run_plan(plan, models, inputs), verify_split(model, result)
"""

from gateway.parallel.execute import LocalShards, PlanExecutor, ShardRunner, run_plan
from gateway.parallel.graph import SplitError
from gateway.parallel.pipeline import split_pipeline_parallel
from gateway.parallel.plan import Boundary, Collective, Fallback, Plan, Segment, Shard, TensorSpec
from gateway.parallel.shards import SplitResult, load_split, shard_config, write_split
from gateway.parallel.tensor import split_tensor_parallel
from gateway.parallel.verify import VerifyReport, verify_split

__all__ = [
    "Boundary",
    "Collective",
    "Fallback",
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
