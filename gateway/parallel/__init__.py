"""Serving split models: the gateway side of model parallelism.

Owns the logical models of the gateway config (``logical``), where each
copy's shards run (``placement``, ``shard_placement``), the per-model serving
state (``served``), the peer groups each copy runs as on its workers
(``groups``) and a batch's calls to them (``peer_run``), the gateway-driven
star that runs shards one by one (``remote``) and the registry that ties them
together (``serving``).

May import: ``splitter`` (plans and the plan executor), ``gateway.fleet``
(cluster view, worker client), ``gateway.batching.assembly`` (the sender seam),
``gateway.types``, ``protos``. Requests enter through ``serving.ParallelModels``,
which ``gateway.core`` calls for a model that has a plan.
"""
