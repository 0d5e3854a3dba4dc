"""Execution backends: ONNX Runtime, the simulated accelerator and the Python backend."""
