"""The fleet: which workers exist, which are healthy, and what runs where.

``cluster`` keeps the gateway's view of its workers and their models (probed;
Triton servers through ``triton_discovery``; its records are in ``view``),
each reached through its replica (``gateway.replicas``); membership sources are the static list (``membership``), DNS
(``discovery``) and self-registration (``registry``, ``worker_reports``);
``placement``, ``rendezvous`` and ``demand`` keep models on workers;
``drain`` empties a worker (its HTTP endpoints are admin routes of the
frontends); ``repository`` forwards the repository extension;
``readiness`` says what the gateway is asked to serve and cannot (strict
readiness); ``manager`` starts and stops these parts in order.

May import: ``gateway.config``, ``gateway.types``, ``gateway.replicas`` (the
replica interface, the worker client the default factory builds), ``protos``,
``serverkit``, tritonclient's stubs. What it
needs from above (the open sequences a drain waits for, the worker token)
is handed in. Nothing here handles an inference request; the router reads the
cluster's view.
"""
