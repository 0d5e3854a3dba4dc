"""The infergate gateway: frontends, batching, routing, cluster membership,
placement, model-parallel plans, metrics and the ``infergate`` CLI."""

__version__ = "0.1.0"
