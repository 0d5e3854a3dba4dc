"""Wire formats shared by every infergate package: the KServe v2 tensor codec,
the error hierarchy with its HTTP and gRPC codes, and our own services' stubs.

The KServe v2 / Triton protocol itself comes from tritonclient's generated
modules (``tritonclient.grpc.service_pb2`` and friends); never compile a
second copy of package ``inference``.
"""
