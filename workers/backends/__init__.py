"""Execution backends of the worker: ONNX Runtime and the simulated accelerator."""
