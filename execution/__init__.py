"""Model execution, below both the worker server and the gateway: everything
it takes to run a model of a Triton-layout repository in this process.

``repository`` reads the repository (``config.pbtxt``, versions, instance
groups, override staging); ``backends`` run models (ONNX Runtime, the
simulated accelerator, Triton Python-backend ``model.py`` files);
``manager`` loads, reloads and unloads model versions; ``model`` is one
loaded version (its instances, drain count and request pipeline);
``tensors`` checks, decodes and encodes a request against a model's
signature; ``decoupled`` turns a decoupled model's responses into
``ModelStreamInferResponse`` messages as they come; ``sequences`` holds stateful models' sequences; ``warmup`` runs
``model_warmup``; ``stats`` counts Triton's statistics; ``devices`` says
which accelerators exist.

The worker server (``workers``) serves it over gRPC; the gateway may call it
in-process as a local replica. May import: ``protos``, ``serverkit``; never
``workers`` or ``gateway``.
"""
