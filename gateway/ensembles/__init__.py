"""Ensembles: Triton's ``platform: "ensemble"`` models, run by the gateway.

``plan`` reads a model's ``ensemble_scheduling`` (steps with ``model_name``,
``model_version``, ``input_map``, ``output_map``) into a checked plan: which
tensor feeds which step, and which steps can run together. ``runner`` runs a
plan for one request: each step is an ordinary request to the step's model,
sent back through the gateway's own request path (validated, batched with
other requests to that model, routed to whatever workers serve it), and the
tensors pass from step to step inside the gateway as bytes.

Workers never run an ensemble: they report its config (so the gateway
learns it like any model) and refuse its requests.

May import: ``gateway.types``, ``protos``. The core calls the runner with a
function that runs one step request (its own inference path).
"""
