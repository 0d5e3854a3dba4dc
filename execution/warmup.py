"""Triton's ``model_warmup``: runs each instance of a newly built model version
on sample requests before the version is installed, so it reports READY only
once first-run costs (graph optimisation, allocator growth, kernel choice) are
paid, and the first real request does not pay them.

Each ``model_warmup`` entry is one sample: ``inputs`` maps every input name to
its ``data_type``, ``dims`` (without the batch dim) and one of
``zero_data``, ``random_data`` or ``input_data_file`` (raw row-major bytes,
BYTES tensors in the 4-byte length-prefixed form, read from the model's
``warmup/`` directory, as in Triton); ``batch_size`` (>= 1) is prepended to
the dims of a batching model; ``count`` runs it that many times (0: once).
Samples run in config order on every instance of every version.

A sample the model refuses fails the load (the version is never installed),
with the sample's name and the model's own message. Warmup runs are not
counted in the statistics, as in Triton.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tritonclient.grpc import model_config_pb2 as mc

from protos import codec
from protos.errors import InferGateError, InvalidArgument
from execution.backends.base import ModelInstance
from execution.repository import wire_datatype

logger = logging.getLogger(__name__)

WARMUP_DIR = "warmup"  # input_data_file names are relative to <model>/warmup/, as in Triton
_RANDOM_SEED = 0


@dataclass(frozen=True, slots=True)
class WarmupSample:
    name: str
    count: int
    inputs: Mapping[str, np.ndarray]


def _array(model: str, sample: str, name: str, spec: mc.ModelWarmup.Input, batch: list[int], model_dir: Path,
           rng: np.random.Generator) -> np.ndarray:
    where = f"warmup sample '{sample}' of model '{model}', input '{name}'"
    datatype = wire_datatype(spec.data_type)
    if any(d < 0 for d in spec.dims):
        raise InvalidArgument(f"{where}: dims must be fixed (no -1), got {list(spec.dims)}")
    shape = [*batch, *spec.dims]
    count = int(np.prod(shape, dtype=np.int64))
    kind = spec.WhichOneof("input_data_type")
    if kind == "input_data_file":
        path = (model_dir / WARMUP_DIR / spec.input_data_file).resolve()
        if (model_dir / WARMUP_DIR).resolve() not in path.parents:
            raise InvalidArgument(f"{where}: input_data_file must name a file inside '{WARMUP_DIR}/'")
        try:
            raw = path.read_bytes()
        except OSError as exc:
            raise InvalidArgument(f"{where}: cannot read {WARMUP_DIR}/{spec.input_data_file}: {exc.strerror}") from None
        try:
            return codec.decode(datatype, shape, raw, name=name)
        except InferGateError as exc:
            raise InvalidArgument(f"{where}: {WARMUP_DIR}/{spec.input_data_file} does not hold a {datatype}"
                                  f"{shape} tensor: {exc.message}") from None
    if datatype == "BYTES":
        items = [b"0" if kind == "zero_data" else str(int(v)).encode() for v in rng.integers(0, 100, count)]
        return np.array(items, dtype=np.object_).reshape(shape)
    dtype = codec.numpy_dtype(datatype)
    if kind == "random_data":
        if np.issubdtype(dtype, np.floating):
            return rng.random(shape).astype(dtype)
        if dtype == np.bool_:
            return rng.integers(0, 2, shape).astype(dtype)
        return rng.integers(0, 100, shape).astype(dtype)  # small: valid as ids, indices and counts
    if kind != "zero_data":
        raise InvalidArgument(f"{where}: give one of zero_data, random_data or input_data_file")
    return np.zeros(shape, dtype=dtype)


def warmup_samples(config: mc.ModelConfig, model_dir: Path) -> list[WarmupSample]:
    """The config's ``model_warmup`` entries as arrays (blocking: reads files). Raises InvalidArgument."""
    rng = np.random.default_rng(_RANDOM_SEED)
    samples: list[WarmupSample] = []
    for index, entry in enumerate(config.model_warmup):
        name = entry.name or f"sample {index}"
        batch: list[int] = []
        if config.max_batch_size > 0:
            if not 1 <= entry.batch_size <= config.max_batch_size:
                raise InvalidArgument(f"warmup sample '{name}' of model '{config.name}': batch_size must be "
                                      f"1..{config.max_batch_size} (max_batch_size), got {entry.batch_size}")
            batch = [entry.batch_size]
        known = {t.name for t in config.input}
        unknown = sorted(set(entry.inputs) - known)
        if unknown:
            raise InvalidArgument(f"warmup sample '{name}' of model '{config.name}' names unknown inputs {unknown}")
        inputs = {
            key: _array(config.name, name, key, spec, batch, model_dir, rng) for key, spec in sorted(entry.inputs.items())
        }
        samples.append(WarmupSample(name, max(1, entry.count), inputs))
    return samples


async def run_warmup(config: mc.ModelConfig, samples: Sequence[WarmupSample],
                     instances: Mapping[int, Sequence[ModelInstance]]) -> None:
    """Run every sample ``count`` times on every instance of every version; raises InvalidArgument on a refusal."""
    if not samples:
        return
    outputs = [t.name for t in config.output]
    start = time.perf_counter()
    runs = 0
    for version, version_instances in sorted(instances.items()):
        for instance in version_instances:
            for sample in samples:
                for _ in range(sample.count):
                    try:
                        await instance.infer(sample.inputs, outputs)
                    except InferGateError as exc:
                        raise InvalidArgument(
                            f"warmup sample '{sample.name}' failed on version {version}: {exc.message}") from None
                    runs += 1
    logger.info("model %s warmed up: %d run(s) of %d sample(s) in %.1f ms",
                config.name, runs, len(samples), (time.perf_counter() - start) * 1000)
