"""What the gateway tells its operators: statistics, metrics, cluster view, dashboard.

``stats`` keeps per-model statistics in Triton's shape; ``latency`` the
end-to-end latency histograms; ``metrics`` serves Prometheus ``/metrics``
from the live counters; ``cluster_api`` serves ``/v2/cluster*`` as JSON;
``dashboard`` serves the page in ``static/``, which polls the cluster API;
``generation_usage`` polls the workers' generation models' sequences and
KV cache for both;
``trace_settings`` holds Triton's trace settings (global and per model) and
``tracing`` the traces the frontends and the core take with them.

May import: ``serverkit`` (the Prometheus text format, tracing),
``gateway.config``, ``gateway.types``, ``gateway.requests``,
``gateway.ensembles`` (the record of an ensemble's steps), ``protos``; never
``gateway.core``: the live gateway is read through the object the process
wiring hands in, typed as the ``Protocol`` in ``observed`` (only what the
observers read). Nothing here is on the request path except the counters
the core updates and the trace contexts (one check while tracing is off).
"""
