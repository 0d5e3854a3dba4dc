"""Split decoders: generation over a decoder whose step runs split across workers.

A logical model whose source is a generation model (``backend: "generate"``,
see ``decoder_source``)::

    models:
      tiny_lm_tp2: {from: tiny_lm, tensor_parallel: 2}
      tiny_lm_pp2: {from: tiny_lm, pipeline_parallel: 2}

answers streams under the source's generation contract, through the same
streaming path as a worker's generation model (gRPC ``ModelStreamInfer``,
``/generate_stream``, the OpenAI API). The decoding loop runs here, in the
gateway: the execution package's generation instance (prompt and sampling
settings, continuous batching, stop strings, the capacity refusal) with a
decoder step (:class:`execution.backends.generate.DecoderStep`) whose graph
run is one run of the logical model's plan: one call per rank (tensor
parallel) or to the first stage (pipeline), as any batch of a split model,
with its retries on another copy. Each sequence's KV cache stays in the
gateway and goes to the shards with every step; the shards hold no state,
so a step a worker failed reruns on another copy and the generations go on.
Greedy output is token for token the unsplit model's (tested).

The step runs on the instance's own thread (padding and unpadding the
caches off the event loop); its plan run is sent to the event loop and
waited for there (:data:`STEP_TIMEOUT_S` at most).

One generation instance per logical model, built when its first stream
comes and rebuilt after the model is loaded again; unloaded, the model is
not found. Streams are served in-process (``gateway.replicas.in_process``):
this object answers as a worker client's streaming side does.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

import numpy as np
from tritonclient.grpc import model_config_pb2, service_pb2

from execution.backends.base import Placement
from execution.backends.generate import DecoderStep, GenerateInstance, int_parameter
from execution.backends.generate_scheduler import GenerationStats
from execution.model import LoadedModel
from gateway.parallel.logical import VERSION
from gateway.parallel.serving import ParallelModels
from gateway.replicas.in_process import in_process_stream
from gateway.replicas.replica import StreamItem
from protos.errors import Internal, ModelNotFound
from splitter.layout_split import LayoutSplit

log = logging.getLogger(__name__)

STEP_TIMEOUT_S = 60.0
ADDRESS = "the gateway (split decoder)"
_WHERE = "a split decoder on the gateway"


@dataclass(slots=True)
class _Decoder:
    layout: LayoutSplit  # the split it was built on: a reload makes a new one
    model: LoadedModel
    instance: GenerateInstance


class SplitDecoders:
    """The generation instances of the split decoders a gateway serves, and their streams."""

    address = ADDRESS

    def __init__(self, parallel: ParallelModels) -> None:
        self._parallel = parallel
        self._decoders: dict[str, _Decoder] = {}
        self._closed = False

    def serves(self, name: str) -> bool:
        """Whether ``name`` is a split generation model (served and loaded now)."""
        if not self._parallel.serves(name):
            return False
        info = self._parallel.model(name)
        return info is not None and info.config.model_transaction_policy.decoupled

    # ---- the model lookup of a local stream call --------------------------------------

    def get(self, name: str, version: str = "") -> LoadedModel:
        info = self._parallel.model(name) if self._parallel.serves(name) else None
        if info is None or self._closed:
            raise ModelNotFound(f"Request for unknown model: '{name}' is not found")
        if version not in ("", VERSION):
            raise ModelNotFound(f"Request for unknown model: '{name}' version {version} is not found")
        layout = self._parallel.layout(name)
        decoder = self._decoders.get(name)
        if decoder is None or decoder.layout is not layout:
            if decoder is not None:
                decoder.instance.close()  # its sequences end with an error: the model was loaded again
            decoder = self._decoders[name] = self._build(name, layout, info.config)
        return decoder.model

    def _build(self, name: str, layout: LayoutSplit, config: model_config_pb2.ModelConfig) -> _Decoder:
        past = [t for t in layout.plan.inputs if t.name.startswith("past_key_")]
        if not past or len(past[0].shape) != 4:
            raise Internal(f"model '{name}': its source is a generation model but its graph has no "
                           "past_key_<layer> input of shape [batch, heads, past, head_dim]")
        loop = asyncio.get_running_loop()
        parallel = self._parallel

        def run(outputs: list[str], feeds: dict[str, np.ndarray]) -> Sequence[np.ndarray]:
            async def plan_run() -> list[np.ndarray]:
                return await parallel.run_arrays(name, feeds, outputs, loop.time() + STEP_TIMEOUT_S)

            # On the instance's thread: the plan runs on the event loop, this thread waits for it.
            return asyncio.run_coroutine_threadsafe(plan_run(), loop).result(STEP_TIMEOUT_S + 5.0)

        step = DecoderStep(run, name, int_parameter(config, "pad_token_id", 0), len(past),
                           int(past[0].shape[1]), int(past[0].shape[3]))
        instance = GenerateInstance(step, config, Placement("cpu", 0))
        limit = int_parameter(config, "max_sequences", 32)
        model = LoadedModel(config, int(VERSION), [instance], max_queue_size=limit)
        log.info("split decoder %s: generating at the gateway over %d shard(s), up to %d sequences", name,
                 len(layout.result.models), limit)
        return _Decoder(layout, model, instance)

    # ---- streams (a StreamSource) ---------------------------------------------------------

    def stream(self, request: service_pb2.ModelInferRequest, timeout_s: float | None) -> AsyncIterator[StreamItem]:
        """One streamed request of a split decoder, its decoding loop run here (``gateway.replicas.in_process``)."""
        return in_process_stream(self, request, timeout_s, _WHERE)

    # ---- views and shutdown ---------------------------------------------------------------

    def generation_stats(self) -> dict[str, GenerationStats]:
        return {name: d.instance.generation_stats() for name, d in self._decoders.items()}

    def close(self) -> None:
        """End every running generation (with an error) and stop the instances' threads."""
        self._closed = True
        for decoder in self._decoders.values():
            decoder.instance.close()
        self._decoders.clear()
