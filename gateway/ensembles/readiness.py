"""Whether an ensemble can run now: every step's model servable, nested
ensembles included (to a bounded depth, so a cycle of ensembles is refused
rather than followed forever).

The core asks this for an ensemble's model readiness (Triton: an ensemble
is ready when its composing models are) and, under strict readiness, for
every ensemble it is asked to serve: one with a missing or unready step
keeps the gateway unready, and the reason names the step.
"""

from __future__ import annotations

from collections.abc import Callable

from tritonclient.grpc import model_config_pb2 as mc

from gateway.ensembles.plan import EnsemblePlan, is_ensemble
from protos.errors import InvalidArgument

MAX_DEPTH = 8

PlanOf = Callable[[mc.ModelConfig], EnsemblePlan]
# The config of a model (version "" = the latest) some replica serves now, else None.
Servable = Callable[[str, str], "mc.ModelConfig | None"]


def missing_step(config: mc.ModelConfig, plan_of: PlanOf, servable: Servable, depth: int = 0) -> str | None:
    """Why the ensemble ``config`` cannot run now (the first step that cannot), or None when it can."""
    if depth > MAX_DEPTH:
        return f"ensemble '{config.name}' nests ensembles deeper than {MAX_DEPTH}"
    try:
        plan = plan_of(config)
    except InvalidArgument as exc:
        return exc.message
    for step in plan.steps:
        step_config = servable(step.model, step.version)
        if step_config is None:
            return f"ensemble '{plan.name}' {step.describe()} has no ready replica"
        if is_ensemble(step_config):
            why = missing_step(step_config, plan_of, servable, depth + 1)
            if why is not None:
                return f"ensemble '{plan.name}' {step.describe()}: {why}"
    return None
