"""Ensemble plans (Triton's ensemble_scheduling checked once) and the runner
with a fake step function: tensors flow between steps by their maps, steps
that wait on nothing run together, a failing step's error names it and keeps
its class, and every step carries the ensemble's deadline."""

from __future__ import annotations

import asyncio

import pytest
from tritonclient.grpc import model_config_pb2 as mc

from gateway.ensembles.plan import build_plan
from gateway.ensembles.runner import Ensembles
from gateway.types import InferRequest, InferResponse, RequestedOutput, Tensor
from protos.errors import DeadlineExceeded, InvalidArgument, Unavailable


def _config(steps: list[tuple[str, dict[str, str], dict[str, str]]], inputs=("IN",), outputs=("OUT",)) -> mc.ModelConfig:
    config = mc.ModelConfig(name="ens", platform="ensemble", max_batch_size=4)
    for name in inputs:
        config.input.add(name=name, data_type=mc.TYPE_INT32, dims=[1])
    for name in outputs:
        config.output.add(name=name, data_type=mc.TYPE_INT32, dims=[1])
    for model, input_map, output_map in steps:
        config.ensemble_scheduling.step.add(model_name=model, model_version=-1, input_map=input_map, output_map=output_map)
    return config


DIAMOND = [
    ("join", {"A": "left", "B": "right"}, {"Y": "OUT"}),
    ("add_one", {"X": "IN"}, {"Y": "left"}),
    ("add_two", {"X": "IN"}, {"Y": "right"}),
]


def test_plan_orders_steps_by_their_tensors() -> None:
    plan = build_plan(_config(DIAMOND))
    assert [sorted(s.model for s in wave) for wave in plan.waves] == [["add_one", "add_two"], ["join"]]
    assert plan.steps[1].version == ""


@pytest.mark.parametrize(
    ("steps", "words"),
    [
        ([], "has no ensemble_scheduling steps"),
        ([("m", {"X": "nowhere"}, {"Y": "OUT"})], "reads tensor 'nowhere', which is neither"),
        ([("m", {"X": "IN"}, {"Y": "mid"})], "output 'OUT' is not produced by any step"),
        ([("m", {"X": "IN"}, {"Y": "OUT"}), ("n", {"X": "IN"}, {"Y": "OUT"})], "already produced by step 0 ('m')"),
        ([("m", {"X": "IN"}, {"Y": "IN"})], "already an ensemble input"),
        ([("m", {"X": "b"}, {"Y": "a"}), ("n", {"X": "a"}, {"Y": "b"}), ("o", {"X": "IN"}, {"Y": "OUT"})], "a cycle"),
    ],
)
def test_malformed_plans_are_refused_with_the_cause(steps, words) -> None:
    with pytest.raises(InvalidArgument, match="ensemble 'ens'") as info:
        build_plan(_config(steps))
    assert words in info.value.message


def _int(value: int) -> Tensor:
    return Tensor("IN", "INT32", (1, 1), value.to_bytes(4, "little", signed=True))


def _value(tensor: Tensor) -> int:
    return int.from_bytes(bytes(tensor.data), "little", signed=True)


class FakeSteps:
    """Step models computed in Python; records every step request."""

    def __init__(self, fail: str = "") -> None:
        self.calls: list[InferRequest] = []
        self.fail = fail
        self.concurrent = 0
        self.peak = 0

    async def __call__(self, request: InferRequest) -> InferResponse:
        self.calls.append(request)
        self.concurrent += 1
        self.peak = max(self.peak, self.concurrent)
        try:
            await asyncio.sleep(0)
            if request.model == self.fail:
                raise Unavailable("no healthy replica")
            values = {t.name: _value(t) for t in request.inputs}
            result = {"add_one": lambda: values["X"] + 1, "add_two": lambda: values["X"] + 2,
                      "join": lambda: values["A"] * values["B"]}[request.model]()
            assert [o.name for o in request.outputs] == ["Y"]
            return InferResponse(request.model, "1", request.id, [Tensor("Y", "INT32", (1, 1), result.to_bytes(4, "little"))])
        finally:
            self.concurrent -= 1


def _request(deadline: float | None = None) -> InferRequest:
    return InferRequest(model="ens", version="1", id="r1", inputs=[_int(5)], outputs=[], deadline=deadline)


async def test_tensors_flow_between_steps_and_independent_steps_run_together() -> None:
    steps = FakeSteps()
    ensembles = Ensembles(steps)
    deadline = asyncio.get_running_loop().time() + 60
    response = await ensembles.run(ensembles.plan(_config(DIAMOND)), _request(deadline))
    assert [t.name for t in response.outputs] == ["OUT"]
    assert _value(response.outputs[0]) == (5 + 1) * (5 + 2)
    assert (response.model, response.id) == ("ens", "r1")
    assert steps.peak == 2  # add_one and add_two at once
    assert all(call.deadline == deadline and call.id == "r1" for call in steps.calls)
    assert {(c.model, tuple(t.name for t in c.inputs)) for c in steps.calls} == {
        ("add_one", ("X",)), ("add_two", ("X",)), ("join", ("A", "B"))}


async def test_a_failing_step_is_named_and_keeps_its_class() -> None:
    ensembles = Ensembles(FakeSteps(fail="add_two"))
    with pytest.raises(Unavailable) as info:
        await ensembles.run(ensembles.plan(_config(DIAMOND)), _request())
    assert info.value.message == "in ensemble 'ens' step 2 ('add_two'): no healthy replica"


async def test_the_deadline_covers_the_whole_ensemble() -> None:
    steps = FakeSteps()
    ensembles = Ensembles(steps)
    past = asyncio.get_running_loop().time() - 1
    with pytest.raises(DeadlineExceeded, match="ensemble 'ens' ran past its deadline"):
        await ensembles.run(ensembles.plan(_config(DIAMOND)), _request(past))
    assert steps.calls == []


async def test_requested_outputs_and_plans_follow_the_config() -> None:
    ensembles = Ensembles(FakeSteps())
    config = _config(DIAMOND, outputs=("OUT",))
    request = _request()
    request.outputs = [RequestedOutput("OUT")]
    response = await ensembles.run(ensembles.plan(config), request)
    assert [t.name for t in response.outputs] == ["OUT"]
    assert ensembles.plan(config) is ensembles.plan(config)
    config.ensemble_scheduling.step[0].model_version = 2
    assert ensembles.plan(config).steps[0].version == "2"
