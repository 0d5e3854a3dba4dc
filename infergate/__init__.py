"""The ``infergate`` command: one entry point for every process and tool.

``infergate.cli`` dispatches a subcommand to the package that owns it
(gateway, workers, splitter, batchjobs, loadtest, models), importing only
that package, lazily. It is the one module allowed to name both ``gateway``
and ``workers``. A command that is only a client of a running gateway lives
here itself (``drain``: drain a worker through the gateways' admin endpoints).
"""
