"""Dynamic batching: one queue per model that turns single requests into batches.

``batcher`` owns the scheduling loop and the tasks that run each batch,
``request_queue`` the per-priority queues, timers and answers, ``seams`` the
protocols it depends on (capacity, clock, dispatch); ``policy`` holds a model's batching settings (Triton's
``dynamic_batching`` plus the adaptive mode); ``registry`` the live batchers by model
and version; ``assembly`` turns a batch into
one worker call and the reply back into one response per request.

May import: ``gateway.types``, ``protos``. The core puts each validated
request into its model's ``Batcher``; a formed batch leaves through the
runner the core gives it (the router).
"""
