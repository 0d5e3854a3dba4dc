"""Several gateway processes behind one pair of ports (``--processes N``).

``supervisor`` (the parent) reserves the HTTP, gRPC and internal peer ports,
starts N children and stops them all on SIGTERM; ``spec`` is what a child is
told (config, index, ports, the group's secret). Every child binds the public
ports with SO_REUSEPORT, so the kernel spreads connections across them, and
batches and routes on its own. ``peers`` is a child's (and the supervisor's)
client of the others' internal endpoint; ``merge`` sums their answers
exactly (Triton statistics, Prometheus families, cluster documents);
``group`` holds the parts a child's core is handed in place of one
process's (through ``gateway.composition``): child 0 (the leader) takes
placement, load/unload and drain decisions, the others forward those to it;
``replicated`` keeps Triton's extension state (shared-memory regions, log
and trace settings) alike in every process; ``registrations`` passes
workers' registrations, heartbeats and deregistrations on to every process;
``routes`` serves the whole-gateway observability and drain endpoints and
the internal ones.

May import: ``gateway.config``, ``gateway.fleet``, ``gateway.routing``,
``gateway.observability``, ``gateway.requests`` and ``gateway.frontends``
(error responses, the extension state it extends), ``serverkit``,
``protos``; never ``gateway.core``: it supplies parts, the composition root
(``gateway.composition``) wires them, and the routes read the core through a
``Protocol``. ``gateway.app`` imports this package, never the other way round.
"""
