"""The infergate gateway: the serving path between clients and workers.

A request enters at ``frontends.http_api`` or ``frontends.grpc_api`` and goes
on to ``core.pipeline`` (its steps, named, in one file; ``docs/architecture.md``
walks through them); ``composition`` builds every part, ``app`` wires a process
together.

The layers, one a line with what it owns, from the lowest (1) to the
highest: a module may import modules of its own layer or of a lower-numbered
one, never of a higher-numbered one; this package's root (``gateway``) may be
imported by all. This list is the one statement of the rule:
``tests/unit/test_architecture.py`` reads it from here and fails on an import
against it, naming both files. A layer named here may be absent while it is
being built.

1. ``settings``: every part's settings records, nested per concern; imports nothing of ours.
2. ``config``: the one loader: config file, flags and environment into those settings.
3. ``types``: the internal request and response, and the core's protocol for the frontends.
4. ``limits``: gateway-wide admission (requests and bytes in flight) and deadlines.
5. ``requests``: request logic below the core: validation, classification, shared memory.
6. ``ensembles``: Triton ensembles, each step a request through the core.
7. ``observability``: statistics, latency, Prometheus metrics, cluster API, dashboard, tracing.
8. ``caching``: the response cache (Triton's ``response_cache``).
9. ``batching``: the per-model queue and its policy, batch assembly.
10. ``replicas``: the replica interface and its implementations: the gRPC worker client (its transports), the local replica.
11. ``fleet``: cluster view, membership, placement, the drain procedure.
12. ``routing``: replica choice, attempts, retry budget, hedging, ejection, sequences, the one routing path.
13. ``parallel``: serving split models (plans come from ``splitter``).
14. ``frontends``: HTTP/REST and gRPC, wire codecs, guards, admin routes, HTTP error answers.
15. ``security``: API keys, TLS, the frontends' access checks, the worker token.
16. ``multiproc``: several gateway processes behind one pair of ports.
17. ``core``: the request path as named steps (``core.pipeline``), model resolution, metadata and repository calls.
18. ``composition``: builds every part from the config and hands each its collaborators.
19. ``app``, ``serve``: process wiring: which parts start and stop in which order; ``serve``: the gateway running its models itself.
20. ``up``: a local cluster (workers and a gateway) in one command.

May import, besides: ``execution`` (models run in this process, as a local
replica), ``protos``, ``serverkit``, ``splitter``; never ``workers``,
``loadtest`` or ``batchjobs``.
"""

__version__ = "0.1.0"
