"""The model repository on disk, in Triton's layout, and everything read from it.

    <root>/<model>/config.pbtxt        ModelConfig in protobuf text format (optional)
    <root>/<model>/<version>/<file>    one directory per integer version

Owns: listing models, parsing ``config.pbtxt`` (protobuf ``text_format`` into
tritonclient's ``ModelConfig``) or a JSON config given with a load request,
the version policy (``latest``, ``all``, ``specific``), turning
``instance_group`` into instance placements, and staging load-with-override
files into a worker-private directory. The user's repository is only ever read.

Filling in what a config leaves out from the model file (Triton's
auto-complete) belongs to the backend, which knows the file format.
"""

from __future__ import annotations

import logging
import re
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path, PurePosixPath

from google.protobuf import json_format, text_format
from tritonclient.grpc import model_config_pb2 as mc

from protos.errors import InvalidArgument
from execution.backends.base import DeviceKind, Placement

logger = logging.getLogger(__name__)

CONFIG_FILENAME = "config.pbtxt"
# A model name is one path component; anything else could escape the repository.
_MODEL_NAME = re.compile(r"^[A-Za-z0-9_.\-]+$")

_WIRE_BY_CONFIG: dict[int, str] = {
    mc.TYPE_BOOL: "BOOL",
    mc.TYPE_UINT8: "UINT8",
    mc.TYPE_UINT16: "UINT16",
    mc.TYPE_UINT32: "UINT32",
    mc.TYPE_UINT64: "UINT64",
    mc.TYPE_INT8: "INT8",
    mc.TYPE_INT16: "INT16",
    mc.TYPE_INT32: "INT32",
    mc.TYPE_INT64: "INT64",
    mc.TYPE_FP16: "FP16",
    mc.TYPE_FP32: "FP32",
    mc.TYPE_FP64: "FP64",
    mc.TYPE_STRING: "BYTES",
    mc.TYPE_BF16: "BF16",
}
_CONFIG_BY_WIRE: dict[str, int] = {wire: config for config, wire in _WIRE_BY_CONFIG.items()}


def wire_datatype(data_type: int) -> str:
    """KServe datatype ("FP32", "BYTES") of a config ``DataType`` (TYPE_FP32, TYPE_STRING)."""
    try:
        return _WIRE_BY_CONFIG[data_type]
    except KeyError:
        raise InvalidArgument(f"unsupported data type {mc.DataType.Name(data_type)}") from None


def config_datatype(datatype: str) -> int:
    """Config ``DataType`` of a KServe datatype."""
    try:
        return _CONFIG_BY_WIRE[datatype]
    except KeyError:
        raise InvalidArgument(f"unknown datatype {datatype!r}") from None


# A model name is a directory name: at most NAME_MAX bytes on every common file system.
MAX_MODEL_NAME_BYTES = 255


def valid_model_name(name: str) -> bool:
    return bool(_MODEL_NAME.match(name)) and name not in (".", "..") and len(name.encode()) <= MAX_MODEL_NAME_BYTES


def check_model_name(name: str) -> None:
    if len(name.encode()) > MAX_MODEL_NAME_BYTES:
        raise InvalidArgument(f"invalid model name {name[:32]!r}...: longer than {MAX_MODEL_NAME_BYTES} bytes")
    if not valid_model_name(name):
        raise InvalidArgument(f"invalid model name {name!r}: use letters, digits, '_', '-' and '.'")


class ModelRepository:
    """Read-only view of one repository root."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def names(self) -> list[str]:
        """Every model directory, sorted; hidden entries are skipped."""
        if not self.root.is_dir():
            return []
        return sorted(p.name for p in self.root.iterdir() if p.is_dir() and not p.name.startswith("."))

    def model_dir(self, name: str) -> Path | None:
        """The directory of model ``name``, or None when the repository has none."""
        if not valid_model_name(name):
            return None
        path = self.root / name
        return path if path.is_dir() else None


def read_config(model_dir: Path, name: str) -> mc.ModelConfig:
    """The model's ``config.pbtxt``, or an empty config (to be auto-completed) when there is none."""
    path = model_dir / CONFIG_FILENAME
    config = mc.ModelConfig()
    if path.is_file():
        try:
            text_format.Parse(path.read_text(encoding="utf-8"), config)
        except (text_format.ParseError, UnicodeDecodeError) as exc:
            raise InvalidArgument(f"{CONFIG_FILENAME} of model '{name}' is not a valid ModelConfig: {exc}") from None
    return _named(config, name)


def parse_config_json(text: str, name: str) -> mc.ModelConfig:
    """A ModelConfig given as JSON (the ``config`` parameter of a load request), as Triton reads it."""
    config = mc.ModelConfig()
    try:
        json_format.Parse(text, config)
    except json_format.ParseError as exc:
        raise InvalidArgument(f"'config' parameter for model '{name}' is not a valid ModelConfig: {exc}") from None
    return _named(config, name)


def _named(config: mc.ModelConfig, name: str) -> mc.ModelConfig:
    if not config.name:
        config.name = name
    elif config.name != name:
        raise InvalidArgument(f"config of model '{name}' names a different model, '{config.name}'")
    return config


def available_versions(model_dir: Path) -> list[int]:
    """Integer-named subdirectories, ascending."""
    versions = [int(p.name) for p in model_dir.iterdir() if p.is_dir() and p.name.isdigit()]
    return sorted(versions)


def select_versions(config: mc.ModelConfig, available: list[int]) -> list[int]:
    """The versions the config's ``version_policy`` serves (default: the latest one), ascending.

    As in Triton, a ``specific`` policy loads the listed versions that exist
    and leaves the others out (see :func:`missing_versions`); it fails only
    when none of them exists.
    """
    name = config.name
    if not available:
        raise InvalidArgument(f"model '{name}' has no version directory (e.g. '{name}/1/')")
    policy = config.version_policy
    which = policy.WhichOneof("policy_choice")
    if which == "all":
        return list(available)
    if which == "specific":
        wanted = sorted(set(policy.specific.versions))
        present = [v for v in wanted if v in available]
        if not present:
            raise InvalidArgument(
                f"model '{name}' version policy asks for versions {wanted} and none of them has a version directory"
            )
        return present
    count = policy.latest.num_versions if which == "latest" else 1
    if count < 1:
        raise InvalidArgument(f"model '{name}' version policy 'latest' needs num_versions >= 1")
    return available[-count:]


def missing_versions(config: mc.ModelConfig, available: list[int]) -> dict[int, str]:
    """Versions a ``specific`` policy names that have no directory, each with the reason it is unavailable."""
    if config.version_policy.WhichOneof("policy_choice") != "specific":
        return {}
    return {
        v: f"version {v} is specified for model '{config.name}', but the version directory is not present"
        for v in sorted(set(config.version_policy.specific.versions)) if v not in available
    }


def resolve_instance_groups(config: mc.ModelConfig, gpu_count: int, cpu_instances: int = 1) -> list[Placement]:
    """One placement per execution instance, and the config's groups rewritten to say so.

    As in Triton: no ``instance_group`` means one instance per GPU (or, on the
    CPU, ``cpu_instances``: the backend's choice for using every core);
    ``KIND_AUTO`` is GPU when one is usable; ``KIND_GPU`` without ``gpus``
    means every GPU. Unlike Triton, a ``KIND_GPU`` group on a machine (or with a
    ``--device cpu`` worker) without GPUs runs on the CPU, with a warning, so one
    repository serves on both.
    """
    if not config.instance_group:
        config.instance_group.add(count=1 if gpu_count else max(1, cpu_instances), kind=mc.ModelInstanceGroup.KIND_AUTO)
    placements: list[Placement] = []
    for index, group in enumerate(config.instance_group):
        if group.count < 0:
            raise InvalidArgument(f"model '{config.name}' instance group {index} has a negative count")
        if group.count == 0:
            group.count = 1
        if not group.name:
            group.name = f"{config.name}_{index}"
        kind: DeviceKind
        if group.kind == mc.ModelInstanceGroup.KIND_CPU:
            kind = "cpu"
        elif group.kind == mc.ModelInstanceGroup.KIND_GPU:
            if gpu_count == 0:
                logger.warning("model %s: instance group %s asks for a GPU; none is usable, running on the CPU", config.name, group.name)
            kind = "cuda" if gpu_count else "cpu"
        elif group.kind in (mc.ModelInstanceGroup.KIND_AUTO, mc.ModelInstanceGroup.KIND_MODEL):
            kind = "cuda" if gpu_count else "cpu"
        else:
            raise InvalidArgument(f"model '{config.name}' instance group {group.name}: unsupported kind")
        if kind == "cpu":
            group.kind = mc.ModelInstanceGroup.KIND_CPU
            del group.gpus[:]
            placements.extend(Placement("cpu") for _ in range(group.count))
            continue
        gpus = list(group.gpus) or list(range(gpu_count))
        bad = [g for g in gpus if g < 0 or g >= gpu_count]
        if bad:
            raise InvalidArgument(f"model '{config.name}' instance group {group.name} names GPUs {bad}; this worker has {gpu_count}")
        group.kind = mc.ModelInstanceGroup.KIND_GPU
        group.gpus[:] = gpus
        placements.extend(Placement("cuda", gpu) for gpu in gpus for _ in range(group.count))
    return placements


def stage_override(staging_root: Path, name: str, files: Mapping[str, bytes]) -> Path:
    """Write load-with-override ``file:<version>/<name>`` contents into a new private directory.

    As in Triton, the files form the whole model directory: nothing is taken
    from the repository. The caller owns (and removes) the returned directory.
    """
    staging_root.mkdir(parents=True, exist_ok=True)
    model_dir = Path(tempfile.mkdtemp(prefix=f"{name}.", dir=staging_root))
    try:
        for relative, content in files.items():
            path = PurePosixPath(relative)
            if path.is_absolute() or not path.parts or any(part in ("", ".", "..") for part in path.parts):
                raise InvalidArgument(f"override file path {relative!r} for model '{name}' must be relative, without '..'")
            target = model_dir.joinpath(*path.parts)
            try:
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(content)
            except OSError as exc:  # e.g. a name over the file system's limit: the request's fault
                raise InvalidArgument(
                    f"cannot write override file {relative!r} for model '{name}': {exc.strerror or exc}"
                ) from None
    except BaseException:
        shutil.rmtree(model_dir, ignore_errors=True)
        raise
    return model_dir
