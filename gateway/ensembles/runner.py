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
"""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Awaitable, Callable

from tritonclient.grpc import model_config_pb2 as mc

from gateway.ensembles.plan import EnsemblePlan, Step, build_plan
from gateway.types import InferRequest, InferResponse, RequestedOutput, Tensor
from protos.errors import DeadlineExceeded, InferGateError, Internal, InvalidArgument

StepInfer = Callable[[InferRequest], Awaitable[InferResponse]]


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

    async def run(self, plan: EnsemblePlan, request: InferRequest) -> InferResponse:
        loop = asyncio.get_running_loop()
        pool: dict[str, Tensor] = {t.name: t for t in request.inputs}
        for wave in plan.waves:
            if request.deadline is not None and loop.time() >= request.deadline:
                raise DeadlineExceeded(
                    f"ensemble '{plan.name}' ran past its deadline before {wave[0].describe()}")
            tasks = [asyncio.ensure_future(self._step(plan, step, request, pool)) for step in wave]
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
                    pool: dict[str, Tensor]) -> dict[str, Tensor]:
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
        try:
            response = await self._infer_step(sub)
        except InferGateError as exc:
            raise step_error(plan, step, exc) from None
        by_name = {t.name: t for t in response.outputs}
        produced: dict[str, Tensor] = {}
        for step_output, tensor in step.outputs:
            out = by_name.get(step_output)
            if out is None:  # the step's server answered without it: its fault, not the request's
                raise Internal(f"in ensemble '{plan.name}' {step.describe()}: "
                                      f"the model returned no output '{step_output}'")
            produced[tensor] = Tensor(tensor, out.datatype, tuple(out.shape), out.data)
        return produced
