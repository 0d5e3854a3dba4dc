"""An ensemble's steps, read from its ``ModelConfig`` and checked once.

Triton's format: ``ensemble_scheduling { step [ { model_name, model_version,
input_map { key: <step input> value: <ensemble tensor> }, output_map { key:
<step output> value: <ensemble tensor> } } ] }``; ``model_version`` -1 (or
0) means the latest. Ensemble tensors are the ensemble's inputs and whatever
steps produce. A step runs once every tensor it reads exists; steps that wait
on nothing else run together (``waves``).

Checked here, each a clear error naming the ensemble and the step: no steps,
a tensor produced twice or also an ensemble input, a step input nobody
produces, an ensemble output nobody produces, a cycle.
"""

from __future__ import annotations

from dataclasses import dataclass

from tritonclient.grpc import model_config_pb2 as mc

from protos.errors import InvalidArgument

ENSEMBLE_PLATFORM = "ensemble"


@dataclass(frozen=True, slots=True)
class Step:
    index: int
    model: str
    version: str  # "" = the latest
    inputs: tuple[tuple[str, str], ...]  # (step input, ensemble tensor)
    outputs: tuple[tuple[str, str], ...]  # (step output, ensemble tensor)

    def describe(self) -> str:
        return f"step {self.index} ('{self.model}'" + (f" version {self.version})" if self.version else ")")


@dataclass(frozen=True, slots=True)
class EnsemblePlan:
    name: str
    steps: tuple[Step, ...]
    waves: tuple[tuple[Step, ...], ...]  # in order; the steps of one wave run concurrently
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]


def is_ensemble(config: mc.ModelConfig) -> bool:
    return config.platform == ENSEMBLE_PLATFORM


def build_plan(config: mc.ModelConfig) -> EnsemblePlan:
    """The checked plan of an ensemble config. Raises InvalidArgument naming what is wrong."""
    name = config.name
    if not config.ensemble_scheduling.step:
        raise InvalidArgument(f"ensemble '{name}' has no ensemble_scheduling steps")
    inputs = tuple(t.name for t in config.input)
    outputs = tuple(t.name for t in config.output)
    producer: dict[str, Step] = {}
    steps: list[Step] = []
    for index, raw in enumerate(config.ensemble_scheduling.step):
        if not raw.model_name:
            raise InvalidArgument(f"ensemble '{name}' step {index} names no model")
        version = str(raw.model_version) if raw.model_version > 0 else ""
        step = Step(index, raw.model_name, version, tuple(sorted(raw.input_map.items())),
                    tuple(sorted(raw.output_map.items())))
        for _, tensor in step.outputs:
            if tensor in inputs or tensor in producer:
                raise InvalidArgument(
                    f"ensemble '{name}' {step.describe()}: tensor '{tensor}' is already "
                    + ("an ensemble input" if tensor in inputs else f"produced by {producer[tensor].describe()}"))
            producer[tensor] = step
        steps.append(step)
    for step in steps:
        for step_input, tensor in step.inputs:
            if tensor not in inputs and tensor not in producer:
                raise InvalidArgument(f"ensemble '{name}' {step.describe()}: input '{step_input}' reads tensor "
                                      f"'{tensor}', which is neither an ensemble input nor any step's output")
    for tensor in outputs:
        if tensor not in producer:
            raise InvalidArgument(f"ensemble '{name}': output '{tensor}' is not produced by any step")
    return EnsemblePlan(name, tuple(steps), _waves(name, steps, set(inputs)), inputs, outputs)


def _waves(name: str, steps: list[Step], available: set[str]) -> tuple[tuple[Step, ...], ...]:
    waves: list[tuple[Step, ...]] = []
    pending = list(steps)
    while pending:
        ready = tuple(s for s in pending if all(t in available for _, t in s.inputs))
        if not ready:
            raise InvalidArgument(f"ensemble '{name}': steps {[s.index for s in pending]} wait on each other (a cycle)")
        waves.append(ready)
        for step in ready:
            available.update(t for _, t in step.outputs)
        pending = [s for s in pending if s not in ready]
    return tuple(waves)
