"""The infergate worker server: a KServe v2 gRPC server running models from a
Triton-layout repository with ONNX Runtime (or the simulated accelerator),
and Triton Python-backend models (``model.py``) in its own process.

``server`` wires the process; ``service`` is the gRPC service over the
``execution`` package's model manager (repository, backends, loaded models,
warmup, sequences, statistics, a decoupled model's stream of responses);
``registration`` joins a gateway; ``collective_service`` serves the
collective protocol: ``groups`` runs a split model's ranks with the worker's
peers, over ``peers`` (links and the mailbox), summing as a ring from three
ranks up (``ring``); ``metrics`` and ``auth`` as named.

May import: ``execution``, ``protos``, ``serverkit``; never ``gateway``. A request enters at
``service.InferenceService.ModelInfer``.
"""
