"""Routing: which replica runs a batch, and what happens when it fails.

``router`` sends the batch, or the streamed request, to a healthy replica
that ``choice``'s policy picks (least outstanding work, power of two
choices, by default), one path for both; ``tries`` runs one try on the
replica chosen and judges its failure; ``streams`` sends a stream to the
router or to the models the gateway serves itself;
``capacity`` holds each replica's in-flight bounds and the per-model
capacity the batcher waits on; ``attempts`` races retries, hedges and hang
detection into exactly one answer; ``faults`` tells whether a batch's
INTERNAL failure is the worker's or the batch's; ``retry_budget`` bounds
extra attempts; ``hedging`` decides when a second attempt is due;
``outlier`` ejects workers that serve badly; ``light`` tells light models
from heavy ones (their busy bound); ``sequences`` pins a stateful
sequence to one replica.

May import: ``gateway.fleet`` (cluster view), ``gateway.replicas`` (the
replica interface and its errors),
``gateway.batching`` (the clock seam), ``gateway.types``, ``protos``. A batch
enters at ``Router.infer``, a stream at ``Router.stream``.
"""
