"""Routing: which replica runs a batch, and what happens when it fails.

``router`` picks a healthy replica (least outstanding work, power of two
choices) and sends the batch; ``attempts`` races retries, hedges and hang
detection into exactly one answer; ``faults`` tells whether a batch's
INTERNAL failure is the worker's or the batch's; ``retry_budget`` bounds
extra attempts; ``hedging`` decides when a second attempt is due;
``outlier`` ejects workers that serve badly.

May import: ``gateway.fleet`` (cluster view, worker client),
``gateway.batching`` (the clock seam), ``gateway.types``, ``protos``. A batch
enters at ``Router.run``.
"""
