"""Offline data-parallel jobs (``infergate batch``): stream a data set through
a gateway and write the outputs in row order.

``cli`` is the command; ``job`` runs a job from its settings to its report,
with checkpoints (``checkpoint``) and progress (``progress``); ``pipeline``
sends its chunks concurrently and writes them; ``sources`` and ``arrow`` read
npy/npz/JSONL/Parquet into row chunks (``rows``); ``sinks`` write them;
``client`` is the gRPC client of the gateway.

May import: ``protos``, ``loadtest.inputs`` (model signatures); never the
servers' packages. A job is a client like any other.
"""
