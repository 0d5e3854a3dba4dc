"""The gateway's response cache: Triton's ``response_cache`` answered in front of the workers.

``response_cache`` owns the cache itself: the key of a request (model,
version, inputs, and the requested outputs and parameters that change what a
model answers), a byte-bounded LRU of responses, and the per-model hit and
miss counters that the statistics API and ``/metrics`` report in Triton's
shape. The core looks a validated request up before it queues it: a hit never
reaches a batcher or a worker, so batches hold only the requests that missed.

May import: ``gateway.types``, ``protos``.
"""
