"""How many executions of one model a server runs at once, as its served
``ModelConfig`` says: the one place the worker writes it and the gateway reads it.

Triton runs one execution per model instance, so a Triton server's slots are
its instances: the ``instance_group`` counts, a ``KIND_GPU`` group's count
once per listed GPU. Our worker may run fewer at once than it has instances
(one thread pool, bounded by the cores, serves every model), so it states
the number in the config's ``parameters`` under :data:`PARAMETER`; when that
is present and valid it wins.
"""

from __future__ import annotations

from tritonclient.grpc import model_config_pb2 as mc

__all__ = ["PARAMETER", "execution_slots", "set_execution_slots"]

PARAMETER = "execution_slots"


def execution_slots(config: mc.ModelConfig) -> int:
    """Executions of this model the server runs at once (at least 1)."""
    stated = config.parameters.get(PARAMETER)
    if stated is not None and stated.string_value.isdigit() and int(stated.string_value) > 0:
        return int(stated.string_value)
    instances = 0
    for group in config.instance_group:
        count = max(1, group.count)
        gpus = len(group.gpus) if group.kind == mc.ModelInstanceGroup.KIND_GPU else 0
        instances += count * max(1, gpus)
    return max(1, instances)


def set_execution_slots(config: mc.ModelConfig, slots: int) -> None:
    config.parameters[PARAMETER].string_value = str(max(1, slots))
