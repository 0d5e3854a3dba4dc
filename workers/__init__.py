"""The infergate worker server: a KServe v2 gRPC server running models from a
Triton-layout repository with ONNX Runtime (or the simulated accelerator)."""
