"""The infergate gateway: the serving path between clients and workers.

At the top, ``core`` (the request path: resolve, validate, admit, queue,
route, answer) and ``app`` (process wiring: which parts start and stop in
which order), with ``config`` (one loader that assembles every part's
settings), ``types`` (the internal request and response), ``limits``
(gateway-wide admission and deadlines) and ``up`` (a local cluster in one
command). Below, one package per concern:

- ``frontends``: HTTP/REST and gRPC, their wire codecs, guards, validation;
- ``batching``: the per-model queue and its policy, batch assembly;
- ``routing``: replica choice, attempts, retry budget, hedging, ejection;
- ``fleet``: cluster view, membership, placement, drain, worker client;
- ``security``: API keys, TLS, the frontends' access checks;
- ``observability``: statistics, Prometheus metrics, cluster API, dashboard;
- ``caching``: the response cache (Triton's ``response_cache``);
- ``ensembles``: Triton ensembles, each step a request through the core;
- ``parallel``: serving split models (plans come from ``splitter``).

May import: ``protos``, ``serverkit``, ``splitter``; never ``workers``,
``loadtest`` or ``batchjobs``. A request enters at ``frontends.http_api`` or
``frontends.grpc_api`` and goes on to ``core.Gateway``.
"""

__version__ = "0.1.0"
