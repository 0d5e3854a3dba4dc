"""Wire formats shared by every infergate package: the KServe v2 tensor codec
(``codec``: raw bytes; ``contents_codec``: gRPC typed contents;
``json_codec``: HTTP JSON ``data``), the error hierarchy with its HTTP and
gRPC codes, our own services' stubs (``cluster``: membership;
``collective``: worker-to-worker collectives, with ``collective_tensors``
joining ranks' parts).

The KServe v2 / Triton protocol itself comes from tritonclient's generated
modules (``tritonclient.grpc.service_pb2`` and friends); never compile a
second copy of package ``inference``.
"""
