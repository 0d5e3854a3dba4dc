"""Runs one ensemble request: its plan's steps in waves, each step an ordinary
request to the step's model through the gateway's own request path.

The request's tensors seed a pool of ensemble tensors; each step reads its
inputs from the pool (renamed by ``input_map``), asks for exactly the outputs
its ``output_map`` names, and puts them back under their ensemble names.
Tensors stay bytes throughout: a step's output bytes are the next step's
input bytes, never copied through numpy.

Every step request carries the ensemble's deadline, so the deadline covers
the whole ensemble. A failing step fails the request with the step's own
error class (its HTTP status and gRPC code) and a message naming the
ensemble, the step and the step's model; the other steps of its wave are
cancelled.

Each step that ends (answered or failed) is reported as a ``StepRun`` in the
list the caller hands in: its rows, the time its request waited before its
batch left for a worker (queue) and the time from then to its answer
(compute), from which the core fills the ensemble's statistics and each
step's share of them, as Triton does.
"""

from __future__ import annotations

import asyncio
import copy
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from tritonclient.grpc import model_config_pb2 as mc

from gateway.ensembles.plan import EnsemblePlan, Step, build_plan
from gateway.types import InferRequest, InferResponse, RequestedOutput, Tensor
from protos.errors import DeadlineExceeded, InferGateError, Internal, InvalidArgument

StepInfer = Callable[[InferRequest], Awaitable[InferResponse]]


@dataclass(frozen=True, slots=True)
class StepRun:
    """One step request of one ensemble request, as it ended. Durations in nanoseconds."""

    step: Step
    version: str  # the version that ran ("" when it failed before one was chosen)
    rows: int
    queue_ns: int
    compute_ns: int
    total_ns: int
    error: str = ""  # the error's class name when the step failed


def step_error(plan: EnsemblePlan, step: Step, exc: InferGateError) -> InferGateError:
    """``exc`` (same class, codes and retry hint) with a message that names the failing step."""
    wrapped = copy.copy(exc)
    wrapped.message = f"in ensemble '{plan.name}' {step.describe()}: {exc.message}"
    wrapped.args = (wrapped.message,)
    return wrapped


class Ensembles:
    """Plans by ensemble name (rebuilt when the config changes), and the runner of one request."""

    def __init__(self, infer_step: StepInfer) -> None:
        self._infer_step = infer_step
        self._plans: dict[str, tuple[bytes, EnsemblePlan]] = {}

    def plan(self, config: mc.ModelConfig) -> EnsemblePlan:
        digest = config.SerializeToString(deterministic=True)
        cached = self._plans.get(config.name)
        if cached is not None and cached[0] == digest:
            return cached[1]
        plan = build_plan(config)
        self._plans[config.name] = (digest, plan)
        return plan

    async def run(self, plan: EnsemblePlan, request: InferRequest, runs: list[StepRun] | None = None) -> InferResponse:
        """The ensemble's response; each step that ends is appended to ``runs``."""
        runs = [] if runs is None else runs
        loop = asyncio.get_running_loop()
        pool: dict[str, Tensor] = {t.name: t for t in request.inputs}
        for wave in plan.waves:
            if request.deadline is not None and loop.time() >= request.deadline:
                raise DeadlineExceeded(
                    f"ensemble '{plan.name}' ran past its deadline before {wave[0].describe()}")
            tasks = [asyncio.ensure_future(self._step(plan, step, request, pool, runs)) for step in wave]
            try:
                results = await asyncio.gather(*tasks)
            except BaseException:
                for task in tasks:
                    task.cancel()
                raise
            for produced in results:
                pool.update(produced)
        wanted = [o.name for o in request.outputs] or list(plan.outputs)
        unknown = [name for name in wanted if name not in plan.outputs]
        if unknown:  # validation checks requested outputs already; a plan changed meanwhile
            raise InvalidArgument(f"unexpected inference output '{unknown[0]}' for model '{plan.name}'")
        outputs = [copy.copy(pool[name]) for name in wanted]
        return InferResponse(model=plan.name, version=request.version, id=request.id, outputs=outputs)

    async def _step(self, plan: EnsemblePlan, step: Step, request: InferRequest,
                    pool: dict[str, Tensor], runs: list[StepRun]) -> dict[str, Tensor]:
        inputs = [Tensor(step_input, pool[tensor].datatype, pool[tensor].shape, pool[tensor].data)
                  for step_input, tensor in step.inputs]
        sub = InferRequest(
            model=step.model,
            version=step.version,
            id=request.id,
            inputs=inputs,
            outputs=[RequestedOutput(step_output) for step_output, _ in step.outputs],
            priority=request.priority,
            deadline=request.deadline,
        )
        started = time.monotonic()
        try:
            response = await self._infer_step(sub)
        except InferGateError as exc:
            total_ns = int((time.monotonic() - started) * 1e9)
            runs.append(StepRun(step, sub.version, sub.rows, 0, 0, total_ns, type(exc).__name__))
            raise step_error(plan, step, exc) from None
        ended = time.monotonic()
        # The core stamps `dispatched` when the step's batch leaves for a worker (never, on a cache hit).
        dispatched = min(max(sub.dispatched, started), ended) if sub.dispatched else ended
        runs.append(StepRun(step, response.version or sub.version, sub.rows, int((dispatched - started) * 1e9),
                            int((ended - dispatched) * 1e9), int((ended - started) * 1e9)))
        by_name = {t.name: t for t in response.outputs}
        produced: dict[str, Tensor] = {}
        for step_output, tensor in step.outputs:
            out = by_name.get(step_output)
            if out is None:  # the step's server answered without it: its fault, not the request's
                raise Internal(f"in ensemble '{plan.name}' {step.describe()}: "
                                      f"the model returned no output '{step_output}'")
            produced[tensor] = Tensor(tensor, out.datatype, tuple(out.shape), out.data)
        return produced
