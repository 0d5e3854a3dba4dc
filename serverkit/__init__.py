"""What every infergate server process shares, so the gateway and the worker
never import each other: the Prometheus text format and Triton's per-model
counter families (``prometheus``), NVML held open for GPU readings
(``nvml``), the process plumbing of a long-running server (``process``:
logging set-up, the event loop policy, atomic ready files), the gRPC server
settings that let a server take a burst of calls (``grpc_server``), tracing
(``tracing``: Triton's ``--trace-config``, the OpenTelemetry exporter,
``traceparent`` propagation), binding a gRPC port and the one-line message
for a port it cannot listen on (``listen``) and the done-callback that logs a background task's
death (``tasks``).

May import: the standard library and third-party packages only.
"""
