"""protos/execution_slots.py: a server's concurrent executions of a model, read from its served config."""

from __future__ import annotations

from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from protos.execution_slots import execution_slots, set_execution_slots


def config(text: str) -> mc.ModelConfig:
    return text_format.Parse(text, mc.ModelConfig())


def test_triton_instances_count_once_per_gpu() -> None:
    assert execution_slots(config("")) == 1
    assert execution_slots(config("instance_group { count: 3 kind: KIND_CPU }")) == 3
    assert execution_slots(config("instance_group { count: 2 kind: KIND_GPU gpus: 0 gpus: 1 }")) == 4
    both = "instance_group { count: 2 kind: KIND_GPU gpus: 0 } instance_group { kind: KIND_CPU }"
    assert execution_slots(config(both)) == 3


def test_a_stated_number_wins_and_a_bad_one_is_ignored() -> None:
    c = config("instance_group { count: 4 kind: KIND_CPU }")
    set_execution_slots(c, 2)
    assert execution_slots(c) == 2
    c.parameters["execution_slots"].string_value = "many"
    assert execution_slots(c) == 4
    c.parameters["execution_slots"].string_value = "0"
    assert execution_slots(c) == 4
