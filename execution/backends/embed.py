"""The embedding backend: a Hugging Face encoder export
(:mod:`execution.backends.hf_encoder`) turning texts or token ids into one
vector each, as sentence-transformers computes them.

A request's rows are its inputs: ``text_input`` (BYTES [1], UTF-8 text,
tokenized by the model's own ``tokenizer.json`` with its special tokens, as
``tokenizer(text)`` does) or ``input_ids`` (INT64 [tokens], the model's
input as given, with ``attention_mask`` marking a shorter row's padding).
Each row is checked before anything runs: an input longer than the model's
limit is refused naming the limit (unless the row's
``truncate_prompt_tokens``, INT32 [1], asks to cut it: to that many tokens,
-1 to the limit, keeping the tokenizer's special tokens on a text; a row of
its own, so that rows of different requests may share a batch), a token id outside
the vocabulary naming its size; ONNX Runtime never sees either. The rows
then run in length-sorted groups (little padding, bounded memory), their
token states pooled and normalised as the export's sentence-transformers
files say. Outputs ``embedding`` (FP32 [width]) and ``prompt_tokens``
(INT32 [1], the tokens the row embedded).

Runs on the backend's bounded thread pool (executions x intra-op threads
<= cores); the event loop only awaits it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import onnxruntime as ort
from tritonclient.grpc import model_config_pb2 as mc

from execution.backends.own_session import own_session
from execution.backends.base import BackendOptions, Placement
from execution.backends.hf_encoder import (
    EMBEDDING_OUTPUT,
    IDS_INPUT,
    MASK_INPUT,
    TEXT_INPUT,
    TOKENS_OUTPUT,
    TRUNCATE_INPUT,
    EncoderSettings,
    complete_encoder_config,
    is_encoder_export,
    normalize,
    pool,
    read_encoder,
)
from execution.backends.hf_tokenizer import HFText
from execution.backends.run_errors import classify_run_error
from execution.devices import cpu_count, cuda_device_count
from protos.errors import InvalidArgument

logger = logging.getLogger(__name__)

BACKEND_NAME = "embed"
DEFAULT_MODEL_FILENAME = "model.onnx"
# One run's padded tokens (rows x longest row) and rows: memory stays bounded whatever the request.
RUN_TOKENS = 16384
RUN_ROWS = 64
_CUDA = "CUDAExecutionProvider"  # the provider a GPU placement needs
# The export's outputs, best first: pooled by the export itself, or token states to pool here.
_POOLED = "sentence_embedding"
_TOKEN_STATES = ("last_hidden_state", "token_embeddings")


class EmbedInstance:
    """One session of an encoder export, and the tokenizer and pooling of its files."""

    def __init__(self, session: ort.InferenceSession, text: HFText, settings: EncoderSettings,
                 placement: Placement, executor: ThreadPoolExecutor, model: str) -> None:  # fmt: skip
        self.placement = placement
        self._session: ort.InferenceSession | None = session
        self._text = text
        self._settings = settings
        self._executor = executor
        self._model = model
        inputs = {i.name for i in session.get_inputs()}
        missing = {"input_ids", "attention_mask"} - inputs
        if missing:
            raise InvalidArgument(f"model '{model}': model.onnx has no input {sorted(missing)} (export it with "
                                  "--task feature-extraction)")
        self._token_types = "token_type_ids" in inputs
        outputs = [o.name for o in session.get_outputs()]
        found = next((name for name in (_POOLED, *_TOKEN_STATES) if name in outputs), None)
        if found is None:
            raise InvalidArgument(f"model '{model}': model.onnx has no output {_POOLED}, {' or '.join(_TOKEN_STATES)} "
                                  f"(it has {outputs}; export it with --task feature-extraction)")
        self._output = found
        dims = next(o.shape for o in session.get_outputs() if o.name == found)
        if settings.width and dims and isinstance(dims[-1], int) and dims[-1] != settings.width:
            raise InvalidArgument(f"model '{model}': model.onnx's {found} is {dims[-1]} wide, config.json's "
                                  f"hidden_size {settings.width}")

    async def infer(self, inputs: Mapping[str, np.ndarray], output_names: Sequence[str]) -> dict[str, np.ndarray]:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, self._run, inputs, list(output_names))

    # --- on a pool thread ---------------------------------------------------------------

    def _limits(self, inputs: Mapping[str, np.ndarray], rows: int) -> list[tuple[int, bool]]:
        """Each row's most tokens, and whether a longer row is cut rather than refused."""
        limit = self._settings.max_tokens or (1 << 62)
        if TRUNCATE_INPUT not in inputs:
            return [(limit, False)] * rows
        asked = inputs[TRUNCATE_INPUT].reshape(-1)
        if asked.size != rows:
            raise InvalidArgument(f"'{TRUNCATE_INPUT}' must hold one value a row")
        limits = []
        for value in asked.tolist():
            if value == 0 or value < -1:
                raise InvalidArgument(f"'{TRUNCATE_INPUT}' must be -1 (the model's limit) or a positive number "
                                      "of tokens")
            if value > limit:
                raise InvalidArgument(f"'{TRUNCATE_INPUT}' is {value}, more than model '{self._model}' embeds "
                                      f"({limit} tokens)")
            limits.append((limit if value == -1 else int(value), True))
        return limits

    def _rows(self, inputs: Mapping[str, np.ndarray]) -> list[list[int]]:
        """Each row's token ids, checked (and cut where asked)."""
        if TEXT_INPUT in inputs:
            if IDS_INPUT in inputs:
                raise InvalidArgument(f"send either '{TEXT_INPUT}' (texts) or '{IDS_INPUT}' (token ids), not both")
            texts = inputs[TEXT_INPUT].reshape(-1)
            return self._encode(texts, self._limits(inputs, texts.size))
        if IDS_INPUT not in inputs:
            raise InvalidArgument(f"the request needs '{TEXT_INPUT}' (texts) or '{IDS_INPUT}' (token ids)")
        ids = inputs[IDS_INPUT]
        ids = ids.reshape(1, -1) if ids.ndim == 1 else ids.reshape(ids.shape[0], -1)
        mask = inputs.get(MASK_INPUT)
        if mask is not None:
            if mask.size != ids.size:
                raise InvalidArgument(f"'{MASK_INPUT}' must have the shape of '{IDS_INPUT}'")
            mask = mask.reshape(ids.shape)
        rows = [[int(t) for t in (row if mask is None else row[mask[r] != 0])] for r, row in enumerate(ids)]
        vocab = self._settings.vocab_size
        for index, row in enumerate(rows):
            bad = next((t for t in row if t < 0 or (vocab and t >= vocab)), None)
            if bad is not None:
                raise InvalidArgument(f"input {index}: token id {bad} is not in the vocabulary of model "
                                      f"'{self._model}' ({vocab} tokens: ids 0 to {vocab - 1})")
        limits = self._limits(inputs, len(rows))
        return [self._checked(index, row[:limit] if cut else row, limit)
                for index, (row, (limit, cut)) in enumerate(zip(rows, limits))]

    def _encode(self, texts: np.ndarray, limits: list[tuple[int, bool]]) -> list[list[int]]:
        decoded: list[str] = []
        for index, item in enumerate(texts.tolist()):
            try:
                text = item if isinstance(item, str) else bytes(item).decode("utf-8")
            except UnicodeDecodeError:
                raise InvalidArgument(f"input {index} ('{TEXT_INPUT}' element {index}) is not UTF-8") from None
            decoded.append(text.lower() if self._settings.lower_case else text)
        tokenizer = self._text.tokenizer
        if not any(cut for _, cut in limits):
            encodings = tokenizer.encode_batch(decoded, add_special_tokens=True)
            return [self._checked(i, list(e.ids), limit) for i, (e, (limit, _)) in enumerate(zip(encodings, limits))]
        # Cut as transformers' truncation does: the text's own tokens first, its special tokens kept.
        special = tokenizer.num_special_tokens_to_add(False)
        rows = []
        for index, (e, (limit, cut)) in enumerate(zip(tokenizer.encode_batch(decoded, add_special_tokens=False),
                                                      limits)):
            if cut:
                e.truncate(max(0, limit - special))
            rows.append(self._checked(index, list(tokenizer.post_process(e, None, True).ids), limit))
        return rows

    def _checked(self, index: int, row: list[int], limit: int) -> list[int]:
        if not row:
            raise InvalidArgument(f"input {index} has no tokens")
        if len(row) > limit:
            raise InvalidArgument(
                f"input {index} has {len(row)} tokens; model '{self._model}' embeds at most {limit} "
                f"({self._settings.max_tokens_from}): shorten it, or ask for '{TRUNCATE_INPUT}'")
        return row

    def _run(self, inputs: Mapping[str, np.ndarray], output_names: list[str]) -> dict[str, np.ndarray]:
        session = self._session
        if session is None:
            raise InvalidArgument("model instance was unloaded")
        rows = self._rows(inputs)
        vectors: np.ndarray | None = None
        for group in _groups(rows):
            longest = max(len(rows[i]) for i in group)
            ids = np.full((len(group), longest), self._settings.pad_id, np.int64)
            mask = np.zeros((len(group), longest), np.int64)
            for r, i in enumerate(group):
                ids[r, :len(rows[i])] = rows[i]
                mask[r, :len(rows[i])] = 1
            feeds = {"input_ids": ids, "attention_mask": mask}
            if self._token_types:
                feeds["token_type_ids"] = np.zeros_like(ids)
            try:
                (states,) = session.run([self._output], feeds)
            except Exception as exc:  # ONNX Runtime's status exceptions
                raise classify_run_error(exc, self._model) from None
            if self._output == _POOLED:
                pooled = np.asarray(states, np.float32)
            else:
                pooled = pool(states, mask, self._settings.pooling)
                if self._settings.normalize:
                    pooled = normalize(pooled)
            if vectors is None:
                vectors = np.zeros((len(rows), pooled.shape[1]), np.float32)
            vectors[group] = pooled
        outputs = {EMBEDDING_OUTPUT: vectors if vectors is not None else np.zeros((0, 0), np.float32),
                   TOKENS_OUTPUT: np.array([[len(row)] for row in rows], np.int32)}
        return {name: outputs[name] for name in output_names}

    def close(self) -> None:
        self._session = None  # a run already on a thread holds its own reference


def _groups(rows: list[list[int]]) -> list[list[int]]:
    """Row indices in runs of similar length: sorted by length, each run within RUN_TOKENS padded
    tokens and RUN_ROWS rows."""
    order = sorted(range(len(rows)), key=lambda i: len(rows[i]))
    groups: list[list[int]] = []
    current: list[int] = []
    for i in order:
        longest = len(rows[i])  # sorted: the newest row is the longest of its run
        if current and (len(current) + 1 > RUN_ROWS or (len(current) + 1) * longest > RUN_TOKENS):
            groups.append(current)
            current = []
        current.append(i)
    if current:
        groups.append(current)
    return groups


class EmbedBackend:
    name = BACKEND_NAME
    platform = ""
    default_model_filename = DEFAULT_MODEL_FILENAME

    def __init__(self, options: BackendOptions) -> None:
        cuda = _CUDA in ort.get_available_providers() and cuda_device_count() > 0 and options.device != "cpu"
        self._gpus = cuda_device_count() if cuda else 0
        cores = cpu_count()
        self._threads = options.intra_op_threads or max(1, min(4, cores // 2))
        # Executions at once x intra-op threads <= cores; one instance per execution thread.
        self.execution_threads = options.execution_threads or max(1, cores // self._threads)
        self.cpu_instances = self.execution_threads
        self._executor = ThreadPoolExecutor(max_workers=self.execution_threads, thread_name_prefix="embed-exec")

    def gpu_count(self) -> int:
        return self._gpus

    def describe(self) -> str:
        return (f"embeddings of encoder exports ({self._gpus} GPU(s), {self.execution_threads} execution threads x "
                f"{self._threads} intra-op threads)")

    def complete_config(self, config: mc.ModelConfig, version_dir: Path) -> mc.ModelConfig:
        if not is_encoder_export(version_dir):
            raise InvalidArgument(f"model '{config.name}': the embedding backend serves an encoder's export "
                                  "(model.onnx, config.json and tokenizer.json, as optimum-cli writes them)")
        config = complete_encoder_config(config, version_dir)
        if config.max_batch_size <= 0:
            raise InvalidArgument(f"model '{config.name}': an embedding model is batched (max_batch_size > 0)")
        return config

    def load(self, model_dir: Path, version_dir: Path, config: mc.ModelConfig, placement: Placement) -> EmbedInstance:
        path = version_dir / (config.default_model_filename or DEFAULT_MODEL_FILENAME)
        session = own_session(path, version_dir, placement, self._threads)
        settings = read_encoder(version_dir, config.name)
        instance = EmbedInstance(session, HFText(version_dir, config.name), settings, placement, self._executor,
                                 config.name)
        logger.info("model %s version %s: an encoder export on %s, width %d, %s pooling%s, at most %d tokens (%s)%s",
                    config.name, version_dir.name, placement, settings.width, settings.pooling.name.lower(),
                    ", normalised" if settings.normalize else "", settings.max_tokens, settings.max_tokens_from,
                    "" if settings.sentence_transformers else "; no modules.json: mean pooling, not normalised")
        return instance

    def close(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)


def create_backend(options: BackendOptions) -> EmbedBackend:
    return EmbedBackend(options)
