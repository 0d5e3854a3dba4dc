"""Replicas: the servers a model's requests run on, behind one interface.

``replica`` states what the router, the cluster and placement need of any
replica (:class:`~gateway.replicas.replica.Replica`: ``infer``, ``stream``,
readiness, models, statistics, loads, ``close``); the implementations:

- ``worker_client``: a KServe v2 gRPC server, an infergate worker or a
  Triton server (unary calls, and streamed requests either on a call each,
  ``grpc_stream``, or packed on one long-lived call per worker,
  ``packed_streams``; small unary calls to an infergate worker may ride a
  long-lived stream too, ``unary_stream``; both long-lived calls share
  ``long_call``);
- ``local``: the models of a repository run in this process
  (``infergate serve``), with ``in_process`` for its streams.
- ``openai_server``: an OpenAI-protocol server (vLLM, SGLang, llama.cpp,
  ``transformers serve``), its models served under the generation contract
  (``openai_contract``), its queue and cache use read from its metrics
  (``server_metrics``).

``errors`` names the failures a replica reports beyond ``protos.errors``
(unreachable, busy, a model not ready, ...): the router reads them to tell
a sick replica from a busy one or a request's fault.

May import: ``gateway.settings``, ``protos``, ``serverkit``, ``execution``
(the local replica runs models), tritonclient's stubs. Nothing here chooses
a replica or retries: that is ``gateway.routing``.
"""
