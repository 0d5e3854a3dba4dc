"""Several gateway processes behind one pair of ports (``--processes N``).

``supervisor`` (the parent) reserves the HTTP, gRPC and internal peer ports,
starts N children and stops them all on SIGTERM; ``spec`` is what a child is
told (config, index, ports, the group's secret). Every child binds the public
ports with SO_REUSEPORT, so the kernel spreads connections across them, and
batches and routes on its own. ``peers`` is a child's (and the supervisor's)
client of the others' internal endpoint; ``merge`` sums their answers
exactly (Triton statistics, Prometheus families, cluster documents);
``group`` is the gateway of one child: child 0 (the leader) takes placement,
load/unload and drain decisions, the others forward those to it;
``replicated`` keeps Triton's extension state (shared-memory regions, log
and trace settings) alike in every process; ``registrations`` passes
workers' registrations, heartbeats and deregistrations on to every process;
``routes`` serves the whole-gateway observability and drain endpoints and
the internal ones.

May import: ``gateway.core``, ``gateway.config``, ``gateway.fleet``,
``gateway.observability``, ``gateway.frontends`` (the admin routes, the
extension state it extends), ``serverkit``, ``protos``. ``gateway.app``
imports this package, never the other way round.
"""
