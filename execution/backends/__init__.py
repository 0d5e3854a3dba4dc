"""Execution backends: ONNX Runtime (``onnx``), the simulated accelerator (``sim``), the Python
backend (``python``), generation with continuous batching (``generate``) and embeddings (``embed``)
over Hugging Face exports (``hf_export``, ``hf_encoder``); the two last run a session per
instance (``own_session``)."""
