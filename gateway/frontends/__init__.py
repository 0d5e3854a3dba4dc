"""The gateway's frontends: where client requests enter.

HTTP/REST (``http_api`` with its body codec ``http_codec`` and compressed
bodies ``http_compression``, Triton's raw
binary request form ``raw_binary`` and the management endpoints' JSON
``http_json``; Triton's generate extension, events included, ``http_generate``;
every HTTP error answer through ``http_errors``; the fleet's
admin endpoints, drain and placement, in ``admin_routes``) and gRPC
(``grpc_api`` with its wire conversion ``grpc_wire``, its error edge
``grpc_errors``, the health service ``grpc_health`` and the undecodable-
message guard ``grpc_guard``) decode a wire request into one
``gateway.types.InferRequest`` and encode the answer back. They only decode,
call the core and encode: checking a request, classification and the reads
and writes of Triton's shared-memory regions are request logic, in
``gateway.requests``.

May import: ``gateway.types``, ``gateway.limits``, ``gateway.requests``,
``protos``, and
``gateway.observability``'s tracing (the trace settings they serve, the
trace they open around each inference). Frontends talk
to the core only through the ``InferenceCore`` protocol in ``gateway.types``,
never by importing ``gateway.core``.
"""
