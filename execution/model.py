"""One loaded model version: its instances, the pool that hands them to
requests, the in-flight count that lets an unload drain it, and the request
pipeline check -> wait for an instance -> decode -> run -> encode, timed
into the version's statistics. A decoupled model's requests take
:meth:`LoadedModel.stream` instead (any number of responses each); a unary
request to one is refused in Triton's words.

Concurrency: everything here runs on the event loop thread; only the
backend's ``infer`` leaves it (to an executor thread, for ONNX Runtime).
Callers look a version up and call :meth:`LoadedModel.infer` with no await
in between, and ``infer`` counts itself in-flight before its first await, so
once the manager has removed a version from its table no new request can
start on it, and :meth:`drain` waits for exactly the ones already started.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator, Sequence
from typing import cast

import numpy as np

from tritonclient.grpc import model_config_pb2 as mc
from tritonclient.grpc import service_pb2

from protos.errors import Internal, InvalidArgument, Overloaded, Unsupported
from execution.backends.base import DecoupledInstance, ModelInstance, RequestContext, StreamEvent
from execution.sequences import SequenceBook, SequenceSettings, read_flags
from execution.stats import ExecutionTiming, ModelStats
from execution.tensors import ModelSignature, check_request, decode_inputs, encode_response

logger = logging.getLogger(__name__)

DECOUPLED_UNARY = "ModelInfer RPC doesn't support models with decoupled transaction policy"  # Triton's words


class LoadedModel:
    """One version of one model, ready to serve."""

    def __init__(
        self,
        config: mc.ModelConfig,
        version: int,
        instances: Sequence[ModelInstance],
        *,
        max_queue_size: int,
        sequences: SequenceSettings | None = None,
    ) -> None:
        self.name = config.name
        self.version = version
        self.version_str = str(version)
        self.config = config
        self.signature = ModelSignature.from_config(config)
        self.stats = ModelStats()
        self._instances = list(instances)
        # An ensemble's version holds only its config: the gateway runs its steps.
        self.gateway_only = config.platform == "ensemble"
        self.decoupled = config.model_transaction_policy.decoupled
        # A stateful model (`sequence_batching`): its open sequences and their state. `sequences`
        # comes read at load (with initial-state files); without it, read here from the config alone.
        settings = sequences or SequenceSettings.from_config(config)
        self.sequences = SequenceBook(self.name, settings, config.max_batch_size > 0) if settings else None
        # Idle instances. An instance is in here or held by exactly one request.
        self._free: asyncio.Queue[ModelInstance] = asyncio.Queue()
        for instance in self._instances:
            self._free.put_nowait(instance)
        self._max_queue_size = max_queue_size
        self._waiting = 0
        self._inflight = 0
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def inflight(self) -> int:
        return self._inflight

    @property
    def instances(self) -> list[ModelInstance]:
        """The version's instances (for metrics that read them, e.g. a generation instance's sequences)."""
        return list(self._instances)

    async def infer(self, request: service_pb2.ModelInferRequest) -> service_pb2.ModelInferResponse:
        """Run one request; raises InferGateError subclasses for anything the client got wrong."""
        if self.gateway_only:
            raise Unsupported(f"ensemble '{self.name}' is run by the gateway: send its requests to an infergate gateway")
        if self.decoupled:
            raise Unsupported(DECOUPLED_UNARY)
        clock = time.perf_counter_ns
        start = clock()
        self._begin()
        try:
            checked = check_request(self.signature, request)
            if self.sequences is None:
                instance = await self._acquire()
                try:
                    ready = clock()
                    inputs = decode_inputs(self.signature, request)
                    decoded = clock()
                    outputs = await self._run(instance, inputs, checked.output_names, request)
                    ran = clock()
                finally:
                    self._release(instance)
            else:
                ready, decoded, outputs, ran = await self._infer_in_sequence(request, checked.batch_size, checked.output_names)
            missing = [name for name in checked.output_names if name not in outputs]
            if missing:
                logger.error("model %s version %s: backend returned no %s", self.name, self.version, missing)
                raise Internal("the model did not produce every requested output")
            response = encode_response(request, self.version_str, outputs, checked.output_names)
            done = clock()
            self.stats.record_success(
                ExecutionTiming(
                    batch_size=checked.batch_size,
                    queue_ns=ready - start,
                    compute_input_ns=decoded - ready,
                    compute_infer_ns=ran - decoded,
                    compute_output_ns=done - ran,
                    total_ns=done - start,
                )
            )
            return response
        except Exception:
            self.stats.record_failure(clock() - start)
            raise
        finally:
            self._end()

    async def stream(self, request: service_pb2.ModelInferRequest) -> AsyncIterator[StreamEvent]:
        """Run one request of a decoupled model, yielding each response as the model sends it; the last is final.

        Raises InferGateError subclasses, also after responses (an error the model reported).
        Closing the iterator before the final response (the client went away) cancels the request:
        the model sees ``is_cancelled()``. The request stays in flight, and its instance taken,
        until the model's ``execute`` returns.
        """
        clock = time.perf_counter_ns
        start = clock()
        self._begin()
        # Filled by the event loop only (the backend hops threads with call_soon_threadsafe);
        # unbounded because a model's thread cannot wait on it; one request's responses bound it.
        events: asyncio.Queue[StreamEvent] = asyncio.Queue()
        cancelled = threading.Event()
        holds = 1  # the stream itself; +1 while execute runs: in flight until both are done
        succeeded = False

        def let_go() -> None:
            nonlocal holds
            holds -= 1
            if holds == 0:
                self._end()

        try:
            checked = check_request(self.signature, request)
            instance = await self._acquire()
            try:
                ready = clock()
                inputs = decode_inputs(self.signature, request)
                decoded = clock()
                context = RequestContext(request.id, read_parameters(request), checked.output_names)
                execution = cast(DecoupledInstance, instance).start_decoupled(inputs, context, events.put_nowait, cancelled)
            except BaseException:
                self._release(instance)
                raise
            holds += 1

            def executed(_: asyncio.Future[None]) -> None:
                self._release(instance)
                let_go()

            execution.add_done_callback(executed)
            while True:
                event = await events.get()
                if event.error is not None:
                    raise event.error
                if event.final:
                    break
                yield event
            done = clock()
            succeeded = True
            self.stats.record_success(ExecutionTiming(
                batch_size=checked.batch_size, queue_ns=ready - start, compute_input_ns=decoded - ready,
                compute_infer_ns=done - decoded, compute_output_ns=0, total_ns=done - start,
            ))  # fmt: skip
            yield event
        except BaseException:
            # An error, or the consumer went away (CancelledError, GeneratorExit): either fails the request.
            if not succeeded:
                cancelled.set()
                self.stats.record_failure(clock() - start)
            raise
        finally:
            let_go()

    @staticmethod
    async def _run(instance: ModelInstance, inputs: dict[str, np.ndarray], output_names: list[str],
                   request: service_pb2.ModelInferRequest) -> dict[str, np.ndarray]:  # fmt: skip
        """Run one request; an instance that reads the request's id and parameters (Python models) gets them."""
        with_context = getattr(instance, "infer_with_context", None)
        if with_context is None:
            return await instance.infer(inputs, output_names)
        context = RequestContext(request.id, read_parameters(request), output_names)
        outputs: dict[str, np.ndarray] = await with_context(inputs, output_names, context)
        return outputs

    def _begin(self) -> None:
        self._inflight += 1
        self._idle.clear()

    def _end(self) -> None:
        self._inflight -= 1
        if self._inflight == 0:
            self._idle.set()

    async def _infer_in_sequence(
        self, request: service_pb2.ModelInferRequest, batch_size: int, output_names: list[str]
    ) -> tuple[int, int, dict[str, np.ndarray], int]:
        """One request of a sequence, after the earlier ones of its sequence (see ``execution.sequences``)."""
        book = self.sequences
        assert book is not None
        if self.config.max_batch_size > 0 and batch_size != 1:
            raise InvalidArgument(
                f"inference request to model '{self.name}' must specify batch-size 1 due to requirements of sequence batcher"
            )
        flags = read_flags(self.name, request.parameters)
        sequence = book.open(flags)  # no await since infer() began: arrival order is lock order
        outputs: dict[str, np.ndarray] | None = None
        try:
            async with sequence.lock:
                instance = await self._acquire()
                try:
                    ready = time.perf_counter_ns()
                    inputs = decode_inputs(self.signature, request)
                    inputs.update(book.feeds(sequence, flags, batch_size))
                    decoded = time.perf_counter_ns()
                    wanted = list(dict.fromkeys([*output_names, *book.state_outputs()]))
                    outputs = await instance.infer(inputs, wanted)
                    ran = time.perf_counter_ns()
                finally:
                    self._release(instance)
        finally:
            book.finish(sequence, flags, outputs)
        return ready, decoded, outputs, ran

    async def run_arrays(self, inputs: dict[str, np.ndarray], output_names: list[str]) -> dict[str, np.ndarray]:
        """Run on arrays a peer group already holds (no wire decode or encode), timed into the statistics.

        The caller (a collective group) names tensors from its own plan, so
        no request check runs; a shape the model refuses still fails as the
        backend reports it.
        """
        clock = time.perf_counter_ns
        start = clock()
        self._begin()
        try:
            instance = await self._acquire()
            try:
                ready = clock()
                outputs = await instance.infer(inputs, output_names)
                ran = clock()
            finally:
                self._release(instance)
            missing = [name for name in output_names if name not in outputs]
            if missing:
                raise Internal(f"model '{self.name}' did not produce {missing}")
            batch = next((int(a.shape[0]) for a in inputs.values() if a.ndim > 0), 1) if self.config.max_batch_size > 0 else 1
            self.stats.record_success(ExecutionTiming(batch_size=batch, queue_ns=ready - start, compute_input_ns=0,
                                                      compute_infer_ns=ran - ready, compute_output_ns=0,
                                                      total_ns=ran - start))
            return outputs
        except Exception:
            self.stats.record_failure(clock() - start)
            raise
        finally:
            self._end()

    async def _acquire(self) -> ModelInstance:
        # Take the fast path only when nobody waits: a waiter woken by _release
        # has not yet taken its instance, and must not be overtaken.
        if self._waiting == 0 and not self._free.empty():
            return self._free.get_nowait()
        if self._waiting >= self._max_queue_size:
            raise Overloaded(f"Exceeds maximum queue size for model '{self.name}' ({self._max_queue_size} waiting)")
        self._waiting += 1
        try:
            return await self._free.get()
        finally:
            self._waiting -= 1

    def _release(self, instance: ModelInstance) -> None:
        self._free.put_nowait(instance)

    async def drain(self, timeout_s: float) -> bool:
        """Wait until no request runs on this version; False if ``timeout_s`` passed first."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except asyncio.TimeoutError:
            logger.warning(
                "model %s version %s: %d requests still running after %.1fs; closing it anyway",
                self.name, self.version, self._inflight, timeout_s,
            )  # fmt: skip
            return False
        return True

    def close(self) -> None:
        """Release every instance (and its memory) now."""
        for instance in self._instances:
            try:
                instance.close()
            except Exception:  # one failing instance must not keep the others' memory
                logger.exception("model %s version %s: closing an instance failed", self.name, self.version)
        self._instances.clear()


def read_parameters(request: service_pb2.ModelInferRequest) -> dict[str, object]:
    """The request's parameters as plain values (what a Python model's ``request.parameters()`` holds)."""
    values: dict[str, object] = {}
    for key, param in request.parameters.items():
        kind = param.WhichOneof("parameter_choice")
        if kind is not None and kind != "bytes_param":
            values[key] = getattr(param, kind)
    return values
