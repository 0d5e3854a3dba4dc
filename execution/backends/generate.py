"""The generation backend: decoupled text generation over an ONNX decoder step
with an explicit KV cache (``backend: "generate"``; the example ``tiny_lm``).

Owns reading a request of the generation contract (``text_input``, optional
``max_tokens``, ``temperature``, ``top_p``, ``seed``, ``stop``, as inputs or,
when an input is absent, request parameters of the same names; the request
parameter ``ignore_eos`` makes a generation run to ``max_tokens``), the
model's vocabulary (``execution.backends.vocabulary``: the byte vocabulary
with ``bos_token_id``, ``eos_token_id``, ``pad_token_id`` from the config's
``parameters``, or a Hugging Face model's tokenizer), and running one padded
decoder step (:class:`DecoderStep`: ONNX Runtime here, a split decoder's shards on a gateway). Scheduling the
steps is ``generate_scheduler``'s: each instance owns one :class:`Scheduler`,
and every request of the instance joins its running batch. ONNX Runtime runs
on the instance's own thread, never on the event loop.

A request is admitted (or refused: "... is at capacity (N sequences); retry
later") when it starts, and the instance is free again at once: the
scheduler, not the instance pool, bounds the sequences. Each token goes out
as a response with ``text_output`` = its bytes (and, when the request
parameter ``token_ids`` is true, the parameter ``token_ids``: a JSON list of
the ids of the tokens whose text it completes, usually one); the final one
has no outputs and the parameters ``finish_reason``, ``prompt_tokens`` and
``completion_tokens``.

A request may continue a generation a lost worker began: the parameter
``resume_token_ids`` (a JSON list of ids, or a list) holds the ids already
sent (every ``token_ids`` received, in order; ``protos.generation_tokens``). They are prefilled after the
prompt and count toward ``max_tokens`` and ``completion_tokens``; their text
is not sent again, and what follows is what the uninterrupted generation
would have sent (``generate_scheduler``). ``prompt_tokens`` stays the
prompt's. Without ids, the parameter ``resume_text`` (the text a generation
already sent, as an OpenAI-protocol server in the same pool sends it: no
ids) is tokenized as them.

Config ``parameters``: ``max_sequences`` (admitted at once, default 32),
``max_cache_bytes`` (KV cache they may reserve, default 64 MiB),
``max_batch_sequences`` (sequences in one step; 1 = one at a time, for
comparison; default all), ``max_positions`` (the model's context),
``enable_prefix_caching`` (default true) and ``prefix_block_tokens``
(default 16): the instance's prefix cache (``execution.backends.prefix_cache``),
whose blocks stay in the arrays of the sequence that computed or read them
while it runs, are copied out of them (:meth:`DecoderStep.extract`) when it
ends or when another prompt opens with them, and are fed back by
:class:`DecoderStep` as the past of a prompt that opens with them.

A Hugging Face decoder as ``optimum`` exports it is served with no
``config.pbtxt`` (``execution.backends.hf_export``): its step has the
export's names (``past_key_values.N.key``, ``present.N.key``), its
:class:`Vocabulary` is the model's own tokenizer and chat template
(``execution.backends.hf_tokenizer``), its stop tokens and defaults come
from ``generation_config.json``. Text goes out as the tokenizer's
incremental decode (each response the whole characters a token completed).
For any model the request parameter ``logprobs`` (0 to 20) adds each
token's log probability and its most likely alternatives as the response
parameter ``logprobs``.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnxruntime as ort
from tritonclient.grpc import model_config_pb2 as mc

from execution.backends.own_session import own_session
from execution.backends.prefix_cache import DEFAULT_BLOCK_TOKENS, PrefixCache, PrefixMatch
from execution.backends.base import BackendOptions, Placement, RequestContext, StreamEvent
from execution.backends.generate_scheduler import (
    GenerationStats,
    SamplingParams,
    Scheduler,
    SchedulerLimits,
    StepRow,
    TokenOut,
)
from execution.backends.vocabulary import ByteVocabulary, Vocabulary, as_bytes, logprobs_json
from execution.backends.run_errors import classify_run_error
from execution.devices import cpu_count, cuda_device_count
from protos.errors import InvalidArgument
from protos.generation_tokens import RESUME_TEXT, RESUME_TOKEN_IDS, TOKEN_IDS, ids_text, parse_ids

logger = logging.getLogger(__name__)

BACKEND_NAME = "generate"
DEFAULT_MODEL_FILENAME = "model.onnx"
DEFAULT_MAX_SEQUENCES = 32
DEFAULT_MAX_CACHE_BYTES = 64 * 1024 * 1024
_CUDA = "CUDAExecutionProvider"


RunStep = Callable[[list[str], dict[str, np.ndarray]], Sequence[np.ndarray]]
MAX_LOGPROBS = 20
_DTYPES = {"tensor(float)": np.float32, "tensor(float16)": np.float16}


@dataclass(frozen=True, slots=True)
class _StepCaches:
    """What one step left for its rows: key then value of each layer ([B, H, T, Dh]) and the mask of
    the columns that are real ([B, T])."""

    arrays: tuple[np.ndarray, ...]
    mask: np.ndarray


@dataclass(frozen=True, slots=True)
class RowCache:
    """A sequence's cache: row ``index`` of one step's caches (never changed: each step makes new arrays)."""

    step: _StepCaches
    index: int


class DecoderStep:
    """One decoder step over rows of different lengths: new tokens padded to the longest, caches by the attention mask.

    ``run(output_names, feeds)`` runs the step graph itself: an ONNX Runtime
    session here (:meth:`onnx`), the shards of a split decoder on a gateway.
    It is called on the instance's thread, never on the event loop.

    A row's cache is a :class:`RowCache`: its row of the arrays the step that
    last ran it returned. When the same rows come back in the same order for
    one token each (decoding while no sequence joins or leaves), those
    arrays are fed back as they are, with one more mask column: no copy on
    our side. Otherwise each row's real columns are gathered into new padded
    arrays (one copy, and the padding of earlier steps dropped).
    """

    def __init__(self, run: RunStep, model: str, pad_id: int, layers: int, heads: int, head_dim: int, *,
                 pasts: Sequence[str] | None = None, presents: Sequence[str] | None = None,
                 dtype: type[np.floating] = np.float32, position_ids: bool = True) -> None:  # fmt: skip
        """``pasts``/``presents``: the cache's input and output names, key then value of each layer
        (default the project's own ``past_key_<layer>``); ``heads``: the KV heads."""
        self._run = run
        self._model = model
        self._pad_id = pad_id
        self.layers, self.heads, self.head_dim = layers, heads, head_dim
        self._dtype = dtype
        self._position_ids = position_ids
        self._pasts = list(pasts) if pasts is not None else \
            [f"past_{kind}_{layer}" for layer in range(self.layers) for kind in ("key", "value")]
        self._outputs = ["logits"] + (list(presents) if presents is not None else
                                      [f"present_{kind}_{layer}" for layer in range(self.layers) for kind in ("key", "value")])

    @classmethod
    def onnx(cls, session: ort.InferenceSession, model: str, pad_id: int) -> "DecoderStep":
        past = [i for i in session.get_inputs() if i.name.startswith("past_key_")]
        return cls(_session_runner(session, model), model, pad_id, len(past), int(past[0].shape[1]), int(past[0].shape[3]))

    @classmethod
    def export(cls, session: ort.InferenceSession, model: str, pad_id: int, kv_heads: int,
               head_dim: int) -> "DecoderStep":  # fmt: skip
        """The step of a Hugging Face export: ``past_key_values.N.key`` [batch, kv_heads, past, head_dim] in,
        ``present.N.key`` out; the head counts from config.json where the graph leaves them symbolic."""
        from execution.backends.hf_export import cache_names

        inputs = {i.name: i for i in session.get_inputs()}
        layers, pasts, presents = cache_names(list(inputs), model)
        missing = [n for n in ["logits", *presents] if n not in {o.name for o in session.get_outputs()}]
        if missing or "input_ids" not in inputs or "attention_mask" not in inputs:
            raise InvalidArgument(f"model '{model}': model.onnx is not a decoder with past (missing "
                                  f"{missing or ['input_ids', 'attention_mask']})")
        first = inputs[pasts[0]]
        if len(first.shape) != 4:
            raise InvalidArgument(f"model '{model}': cache input {first.name} is not [batch, heads, past, head_dim]")
        heads = first.shape[1] if isinstance(first.shape[1], int) else kv_heads
        dim = first.shape[3] if isinstance(first.shape[3], int) else head_dim
        dtype = _DTYPES.get(first.type)
        if not heads or not dim or dtype is None:
            raise InvalidArgument(f"model '{model}': cannot tell the cache's heads, head size and type "
                                  f"({first.name}: {first.type} {first.shape})")
        return cls(_session_runner(session, model), model, pad_id, layers, int(heads), int(dim), pasts=pasts,
                   presents=presents, dtype=dtype, position_ids="position_ids" in inputs)

    @property
    def cache_bytes_per_token(self) -> int:
        return 2 * self.layers * self.heads * self.head_dim * np.dtype(self._dtype).itemsize

    def __call__(self, rows: Sequence[StepRow]) -> list[tuple[np.ndarray, object]]:
        first = rows[0].cache
        if isinstance(first, RowCache) and first.step.mask.shape[0] == len(rows) and all(
                isinstance(row.cache, RowCache) and row.cache.step is first.step and row.cache.index == b
                and len(row.tokens) == 1 for b, row in enumerate(rows)):
            return self._continue(first.step, rows)
        return self._gather(rows)

    def _continue(self, last: _StepCaches, rows: Sequence[StepRow]) -> list[tuple[np.ndarray, object]]:
        """The rows of the last step, one token each: its arrays are the past, the mask one column longer."""
        batch = len(rows)
        mask = np.concatenate([last.mask, np.ones((batch, 1), dtype=np.int64)], axis=1)
        feeds: dict[str, np.ndarray] = {
            "input_ids": np.array([row.tokens for row in rows], dtype=np.int64),
            "attention_mask": mask,
        }
        if self._position_ids:
            feeds["position_ids"] = np.array([[row.position] for row in rows], dtype=np.int64)
        feeds.update(zip(self._pasts, last.arrays))
        return self._step(feeds, mask, np.zeros(batch, dtype=np.int64))

    def _gather(self, rows: Sequence[StepRow]) -> list[tuple[np.ndarray, object]]:
        """Any rows: each row's real columns copied into past arrays padded to the longest row."""
        batch = len(rows)
        lengths = np.array([len(r.tokens) for r in rows], dtype=np.int64)
        starts = np.array([r.position for r in rows], dtype=np.int64)
        new, past = int(lengths.max()), int(starts.max())
        columns = np.arange(new, dtype=np.int64)
        real_new = columns[None, :] < lengths[:, None]  # [B, new]: right padding marked False
        ids = np.full((batch, new), self._pad_id, dtype=np.int64)
        for b, row in enumerate(rows):
            ids[b, :len(row.tokens)] = row.tokens
        positions = np.where(real_new, starts[:, None] + columns[None, :], 0)
        mask = np.concatenate([np.arange(past)[None, :] < starts[:, None], real_new], axis=1).astype(np.int64)
        pasts = np.zeros((2 * self.layers, batch, self.heads, past, self.head_dim), dtype=self._dtype)
        for b, row in enumerate(rows):
            cache = row.cache
            if cache is None:
                continue
            if isinstance(cache, PrefixMatch):  # cached blocks: each [2 x layers, H, block, Dh]
                if cache.tokens != row.position:
                    raise ValueError(f"a row at position {row.position} has {cache.tokens} cached positions")
                size = cache.block_tokens
                for i, entries in enumerate(cache.entries):
                    pasts[:, b, :, i * size:(i + 1) * size] = entries
                continue
            if not isinstance(cache, RowCache):
                raise TypeError(f"a row's cache is a {type(cache).__name__}, not this step's RowCache")
            real = np.flatnonzero(cache.step.mask[cache.index])  # its cached positions, in order
            if len(real) != row.position:
                raise ValueError(f"a row at position {row.position} has {len(real)} cached positions")
            if row.position and real[-1] == row.position - 1:  # no padding between them: one slice
                real = slice(0, row.position)  # type: ignore[assignment]
            for k, array in enumerate(cache.step.arrays):
                pasts[k, b, :, :row.position] = array[cache.index][:, real]
        feeds: dict[str, np.ndarray] = {"input_ids": ids, "attention_mask": mask}
        if self._position_ids:
            feeds["position_ids"] = positions
        feeds.update(zip(self._pasts, pasts))
        return self._step(feeds, mask, lengths - 1)

    def extract(self, cache: object, start: int, stop: int) -> np.ndarray:
        """A copy of positions ``start``..``stop`` of a row's cache, every layer's key and value:
        [2 x layers, heads, stop - start, head_dim] (one prefix-cache block's entries)."""
        if not isinstance(cache, RowCache):
            raise TypeError(f"a row's cache is a {type(cache).__name__}, not this step's RowCache")
        real = np.flatnonzero(cache.step.mask[cache.index])[start:stop]  # the row's positions, in order
        if len(real) != stop - start:
            raise ValueError(f"a row's cache holds {len(real)} of positions {start} to {stop}")
        columns: slice | np.ndarray = slice(int(real[0]), int(real[-1]) + 1) \
            if int(real[-1]) - int(real[0]) == stop - start - 1 else real
        return np.stack([array[cache.index][:, columns] for array in cache.step.arrays])

    def _step(self, feeds: dict[str, np.ndarray], mask: np.ndarray,
              last: np.ndarray) -> list[tuple[np.ndarray, object]]:  # fmt: skip
        logits, *presents = self._run(self._outputs, feeds)
        caches = _StepCaches(tuple(presents), mask)
        chosen = logits[np.arange(len(last)), last]  # [B, V]: each row's logits after its last new token (a copy)
        if chosen.dtype != np.float32:
            chosen = chosen.astype(np.float32)
        return [(chosen[b], RowCache(caches, b)) for b in range(len(last))]


def _session_runner(session: ort.InferenceSession, model: str) -> RunStep:
    run = session.run

    def run_session(outputs: list[str], feeds: dict[str, np.ndarray]) -> Sequence[np.ndarray]:
        try:
            return run(outputs, feeds)
        except Exception as exc:  # ONNX Runtime's status exceptions
            raise classify_run_error(exc, model) from None

    return run_session


def int_parameter(config: mc.ModelConfig, key: str, default: int) -> int:
    param = config.parameters.get(key)
    if param is None or not param.string_value:
        return default
    try:
        return int(param.string_value)
    except ValueError:
        raise InvalidArgument(f"model '{config.name}': parameter {key} must be an integer") from None


def _scalar(inputs: Mapping[str, np.ndarray], parameters: Mapping[str, object], name: str, kind: type, default: object) -> object:
    if name in inputs:
        array = inputs[name]
        if array.size != 1:
            raise InvalidArgument(f"input '{name}' must hold one value")
        return kind(array.reshape(-1)[0])
    value = parameters.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidArgument(f"parameter '{name}' must be a number")
    return kind(value)


def sampling_params(inputs: Mapping[str, np.ndarray], parameters: Mapping[str, object],
                    defaults: SamplingParams = SamplingParams()) -> SamplingParams:  # fmt: skip
    """The request's generation settings, checked; inputs first, then parameters of the same names,
    then ``defaults`` (the model's)."""
    max_tokens = int(_scalar(inputs, parameters, "max_tokens", int, defaults.max_tokens))  # type: ignore[call-overload]
    temperature = float(_scalar(inputs, parameters, "temperature", float, defaults.temperature))  # type: ignore[arg-type]
    top_p = float(_scalar(inputs, parameters, "top_p", float, defaults.top_p))  # type: ignore[arg-type]
    top_k = int(_scalar(inputs, parameters, "top_k", int, defaults.top_k))  # type: ignore[call-overload]
    seed = int(_scalar(inputs, parameters, "seed", int, 0))  # type: ignore[call-overload]
    logprobs = int(_scalar(inputs, parameters, "logprobs", int, -1))  # type: ignore[call-overload]
    if max_tokens < 0:
        raise InvalidArgument("max_tokens must be at least 0")
    if not 0.0 <= temperature <= 100.0:
        raise InvalidArgument("temperature must be between 0 and 100")
    if not 0.0 < top_p <= 1.0:
        raise InvalidArgument("top_p must be in (0, 1]")
    if top_k < 0:
        raise InvalidArgument("top_k must be at least 0")
    if seed < 0:
        raise InvalidArgument("seed must be at least 0")
    if not -1 <= logprobs <= MAX_LOGPROBS:
        raise InvalidArgument(f"logprobs must be from 0 to {MAX_LOGPROBS}")
    if "stop" in inputs:
        stop = tuple(as_bytes(v) for v in inputs["stop"].reshape(-1))
    else:
        value = parameters.get("stop")
        stop = (as_bytes(value),) if isinstance(value, str) and value else ()
    ignore_eos = parameters.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise InvalidArgument("parameter 'ignore_eos' must be a bool")
    return SamplingParams(max_tokens, temperature, top_p, seed, tuple(s for s in stop if s), ignore_eos, top_k,
                          logprobs)


def resume_ids(parameters: Mapping[str, object], vocabulary_size: int, end_ids: Sequence[int] = ()) -> list[int]:
    """The request's ``resume_token_ids`` (a JSON list of ids, or a list), checked against the vocabulary
    (and the model's end tokens, which a run's last response may name)."""
    value = parameters.get(RESUME_TOKEN_IDS)
    if value is None or value == "":
        return []
    try:
        ids = parse_ids(value)
    except ValueError:
        raise InvalidArgument(f"parameter '{RESUME_TOKEN_IDS}' must be a JSON list of token ids") from None
    if any(not 0 <= t < vocabulary_size and t not in end_ids for t in ids):
        raise InvalidArgument(f"parameter '{RESUME_TOKEN_IDS}' holds an id outside the vocabulary "
                              f"(0 to {vocabulary_size - 1})")
    return ids


def prefix_cache(config: mc.ModelConfig, bytes_per_token: int) -> PrefixCache | None:
    """The instance's prefix cache from the config's ``enable_prefix_caching`` (default true) and
    ``prefix_block_tokens`` (default 16); None when it is turned off."""
    param = config.parameters.get("enable_prefix_caching")
    value = param.string_value.strip().lower() if param is not None else ""
    if value not in ("", "true", "false", "1", "0", "yes", "no", "on", "off"):
        raise InvalidArgument(f"model '{config.name}': parameter enable_prefix_caching must be true or false")
    if value in ("false", "0", "no", "off"):
        return None
    block = int_parameter(config, "prefix_block_tokens", DEFAULT_BLOCK_TOKENS)
    if block < 1:
        raise InvalidArgument(f"model '{config.name}': parameter prefix_block_tokens must be at least 1")
    return PrefixCache(block, block * bytes_per_token)


class GenerateInstance:
    """One decoder session and the scheduler that batches every request sent to it."""

    def __init__(self, step: DecoderStep, config: mc.ModelConfig, placement: Placement, *,
                 vocabulary: Vocabulary | None = None, eos_ids: Sequence[int] | None = None,
                 defaults: SamplingParams = SamplingParams()) -> None:  # fmt: skip
        """``vocabulary``: the byte vocabulary (BOS from the config's parameters) unless given; ``eos_ids``:
        the config's ``eos_token_id`` unless given; ``defaults``: what a request leaves out."""
        self.placement = placement
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"generate-{config.name}")
        bos = int_parameter(config, "bos_token_id", -1)
        self._vocabulary = vocabulary if vocabulary is not None else ByteVocabulary(bos)
        self._defaults = defaults
        eos = list(eos_ids) if eos_ids is not None else [int_parameter(config, "eos_token_id", -1)]
        limits = SchedulerLimits(
            max_sequences=int_parameter(config, "max_sequences", DEFAULT_MAX_SEQUENCES),
            max_cache_bytes=int_parameter(config, "max_cache_bytes", DEFAULT_MAX_CACHE_BYTES),
            cache_bytes_per_token=step.cache_bytes_per_token,
            max_positions=int_parameter(config, "max_positions", 1 << 30),
            max_batch_sequences=int_parameter(config, "max_batch_sequences", 0),
        )
        if limits.max_sequences < 1 or limits.max_cache_bytes < 1:
            raise InvalidArgument(f"model '{config.name}': max_sequences and max_cache_bytes must be positive")
        # The byte vocabulary never generates its BOS or padding; a tokenizer's model may say what it likes.
        banned = [] if vocabulary is not None else \
            [t for t in (bos, int_parameter(config, "pad_token_id", -1)) if t >= 0]
        self.scheduler = Scheduler(config.name, limits, step, self._offload, eos_id=eos, banned=banned,
                                   prefix=prefix_cache(config, step.cache_bytes_per_token))

    async def _offload(self, call: Callable[[], list[tuple[np.ndarray, object]]]) -> list[tuple[np.ndarray, object]]:
        return await asyncio.get_running_loop().run_in_executor(self._executor, call)

    def generation_stats(self) -> GenerationStats:
        return self.scheduler.stats()

    async def infer(self, inputs: Mapping[str, np.ndarray], output_names: Sequence[str]) -> dict[str, np.ndarray]:
        raise InvalidArgument("a generation model answers streams only")  # LoadedModel refuses unary calls first

    def start_decoupled(self, inputs: Mapping[str, np.ndarray], context: RequestContext,
                        emit: Callable[[StreamEvent], None], cancelled: threading.Event) -> asyncio.Future[None]:  # fmt: skip
        vocabulary = self._vocabulary
        prompt = vocabulary.prompt_ids(inputs)
        params = sampling_params(inputs, context.parameters, self._defaults)
        resume = resume_ids(context.parameters, vocabulary.size, self.scheduler.eos_ids)
        if not resume and RESUME_TEXT in context.parameters:  # begun where no ids were named: its text's
            resume = vocabulary.text_ids(str(context.parameters[RESUME_TEXT]))
        name_tokens = context.parameters.get(TOKEN_IDS, False)
        if not isinstance(name_tokens, bool):
            raise InvalidArgument(f"parameter '{TOKEN_IDS}' must be a bool")

        def send(out: TokenOut) -> None:
            if out.error is not None:
                emit(StreamEvent({}, True, out.error))
            elif out.data is not None:
                extra: dict[str, object] = {}
                if name_tokens and out.token_ids:
                    extra[TOKEN_IDS] = ids_text(out.token_ids)
                if out.logprobs is not None:
                    extra["logprobs"] = logprobs_json(vocabulary, out.logprobs)
                emit(StreamEvent({"text_output": np.array([out.data], dtype=np.object_)}, False, parameters=extra))
            else:
                emit(StreamEvent({}, True, parameters={"finish_reason": out.finish_reason or "stop",
                                                       "prompt_tokens": out.prompt_tokens,
                                                       "completion_tokens": out.completion_tokens}))

        self.scheduler.admit(prompt, params, send, cancelled, vocabulary.text_stream(), resume)
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        done.set_result(None)  # admitted: the instance may take the next request now
        return done

    def close(self) -> None:
        self.scheduler.close()
        self._executor.shutdown(wait=False, cancel_futures=True)


class GenerateBackend:
    name = BACKEND_NAME
    platform = ""
    default_model_filename = DEFAULT_MODEL_FILENAME
    cpu_instances = 1  # one scheduler batches every sequence; more would split the batch
    execution_threads = 0  # each instance has its own thread

    def __init__(self, options: BackendOptions) -> None:
        self._options = options
        cuda = _CUDA in ort.get_available_providers() and cuda_device_count() > 0 and options.device != "cpu"
        self._gpus = cuda_device_count() if cuda else 0
        # Half the cores (1 to 4): the event loop beside it writes a response per token, and a
        # pool as wide as the machine fights it for the cores (measured on 2 cores: 2.8x the
        # tokens/s of 16 sequences with 1 thread than with 2).
        self._threads = options.intra_op_threads or max(1, min(4, cpu_count() // 2))

    def gpu_count(self) -> int:
        return self._gpus

    def describe(self) -> str:
        return f"generation over ONNX decoder steps ({self._gpus} GPU(s), {self._threads} intra-op threads on the CPU)"

    def complete_config(self, config: mc.ModelConfig, version_dir: Path) -> mc.ModelConfig:
        from execution.backends.hf_export import complete_export_config, is_decoder_export

        if is_decoder_export(version_dir):
            config = complete_export_config(config, version_dir)
        if not config.model_transaction_policy.decoupled:
            raise InvalidArgument(f"model '{config.name}': a generation model must be decoupled")
        if [i.name for i in config.input][:1] != ["text_input"] or "text_output" not in {o.name for o in config.output}:
            raise InvalidArgument(f"model '{config.name}': a generation model takes text_input and gives text_output")
        filename = config.default_model_filename or DEFAULT_MODEL_FILENAME
        if not (version_dir / filename).is_file():
            raise InvalidArgument(f"model '{config.name}': no {filename} in version directory {version_dir.name}")
        # The sequences an instance runs at once, stated: a gateway bounds the streams it sends by them
        # (gateway.routing.capacity), not by the one instance.
        if not config.parameters["max_sequences"].string_value:
            config.parameters["max_sequences"].string_value = str(DEFAULT_MAX_SEQUENCES)
        return config

    def load(self, model_dir: Path, version_dir: Path, config: mc.ModelConfig, placement: Placement) -> GenerateInstance:
        path = version_dir / (config.default_model_filename or DEFAULT_MODEL_FILENAME)
        session = own_session(path, version_dir, placement, self._threads)
        logger.info("model %s version %s: generation instance on %s", config.name, version_dir.name, placement)
        from execution.backends.hf_export import is_decoder_export

        if is_decoder_export(version_dir):
            return self._load_export(session, version_dir, config, placement)
        if not any(i.name == "past_key_0" for i in session.get_inputs()):
            raise InvalidArgument(f"model '{config.name}': {path.name} is not a decoder step (no past_key_0 input)")
        step = DecoderStep.onnx(session, config.name, int_parameter(config, "pad_token_id", 0))
        return GenerateInstance(step, config, placement)

    @staticmethod
    def _load_export(session: ort.InferenceSession, version_dir: Path, config: mc.ModelConfig,
                     placement: Placement) -> GenerateInstance:  # fmt: skip
        """A Hugging Face export: its step, tokenizer, stop tokens and defaults from its own files."""
        from execution.backends.hf_export import read_export
        from execution.backends.hf_tokenizer import HFText, TokenizerVocabulary

        settings = read_export(version_dir, config.name)
        text = HFText(version_dir, config.name)
        step = DecoderStep.export(session, config.name, settings.pad_id, settings.kv_heads, settings.head_dim)
        eos = settings.eos_ids
        if not eos and (token := text.special_tokens.get("eos_token")) is not None:
            found = text.token_id(token)
            eos = (found,) if found is not None else ()
        logger.info("model %s: a Hugging Face export, %d layers of %d KV heads x %d, context %d, stop tokens %s",
                    config.name, step.layers, step.heads, step.head_dim, settings.max_positions, list(eos))
        return GenerateInstance(step, config, placement, vocabulary=TokenizerVocabulary(text), eos_ids=eos,
                                defaults=settings.defaults)

    def close(self) -> None:
        pass


def create_backend(options: BackendOptions) -> GenerateBackend:
    return GenerateBackend(options)
