"""Unit tests for execution/repository.py: config parsing, versions, instance groups, staging."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
from tritonclient.grpc import model_config_pb2 as mc

from protos.errors import InvalidArgument
from execution.backends.base import Placement
from execution.repository import (
    ModelRepository,
    available_versions,
    check_model_name,
    config_datatype,
    parse_config_json,
    read_config,
    resolve_instance_groups,
    select_versions,
    stage_override,
    wire_datatype,
)

KIND = mc.ModelInstanceGroup


def _model_dir(root: Path, name: str, versions: list[str], config: str | None = None) -> Path:
    path = root / name
    path.mkdir(parents=True)
    for version in versions:
        (path / version).mkdir()
    if config is not None:
        (path / "config.pbtxt").write_text(config)
    return path


def test_repository_lists_model_directories_only(tmp_path: Path) -> None:
    _model_dir(tmp_path, "b", ["1"])
    _model_dir(tmp_path, "a", ["1"])
    _model_dir(tmp_path, ".hidden", ["1"])
    (tmp_path / "README.md").write_text("not a model")
    repo = ModelRepository(tmp_path)
    assert repo.names() == ["a", "b"]
    assert repo.model_dir("a") == tmp_path / "a"
    assert repo.model_dir("missing") is None
    assert repo.model_dir("../etc") is None
    assert ModelRepository(tmp_path / "nowhere").names() == []


def test_read_config_parses_text_format(tmp_path: Path) -> None:
    path = _model_dir(
        tmp_path,
        "m",
        ["1"],
        'name: "m"\nmax_batch_size: 8\ninput { name: "X" data_type: TYPE_FP32 dims: [ 4 ] }\n'
        'instance_group { count: 2 kind: KIND_CPU }\n',
    )
    config = read_config(path, "m")
    assert config.max_batch_size == 8
    assert [(t.name, t.data_type, list(t.dims)) for t in config.input] == [("X", mc.TYPE_FP32, [4])]
    assert config.instance_group[0].count == 2


def test_read_config_without_file_is_empty_but_named(tmp_path: Path) -> None:
    config = read_config(_model_dir(tmp_path, "m", ["1"]), "m")
    assert config.name == "m"
    assert not config.input and config.max_batch_size == 0


@pytest.mark.parametrize(
    "text, fragment",
    [("max_batch_size: eight", "not a valid ModelConfig"), ('name: "other"', "different model, 'other'")],
)
def test_read_config_rejects_bad_files(tmp_path: Path, text: str, fragment: str) -> None:
    with pytest.raises(InvalidArgument, match=fragment) as info:
        read_config(_model_dir(tmp_path, "m", ["1"], text), "m")
    assert info.value.grpc_code == grpc.StatusCode.INVALID_ARGUMENT


def test_parse_config_json_reads_triton_json() -> None:
    config = parse_config_json(
        '{"max_batch_size": 4, "input": [{"name": "X", "data_type": "TYPE_INT64", "dims": [-1]}],'
        ' "instance_group": [{"kind": "KIND_CPU", "count": 3}]}',
        "m",
    )
    assert config.name == "m"
    assert config.input[0].data_type == mc.TYPE_INT64 and list(config.input[0].dims) == [-1]
    assert config.instance_group[0].count == 3
    with pytest.raises(InvalidArgument, match="not a valid ModelConfig"):
        parse_config_json('{"max_batch_size": "many"}', "m")


def test_available_versions_are_numeric_and_sorted(tmp_path: Path) -> None:
    path = _model_dir(tmp_path, "m", ["10", "2", "1", "tmp", "003"])
    (path / "7").write_text("a file, not a version")
    assert available_versions(path) == [1, 2, 3, 10]


@pytest.mark.parametrize(
    "policy, expected",
    [
        ("", [3]),
        ("version_policy { latest { num_versions: 2 } }", [2, 3]),
        ("version_policy { all { } }", [1, 2, 3]),
        ("version_policy { specific { versions: [ 2, 1 ] } }", [1, 2]),
    ],
)
def test_select_versions_follows_the_policy(policy: str, expected: list[int]) -> None:
    from google.protobuf import text_format

    config = text_format.Parse(f'name: "m" {policy}', mc.ModelConfig())
    assert select_versions(config, [1, 2, 3]) == expected


def test_select_versions_errors() -> None:
    with pytest.raises(InvalidArgument, match="no version directory"):
        select_versions(mc.ModelConfig(name="m"), [])
    config = mc.ModelConfig(name="m")
    config.version_policy.specific.versions.append(5)
    with pytest.raises(InvalidArgument, match=r"\[5\]"):
        select_versions(config, [1, 2])


def test_instance_groups_default_to_one_cpu_instance() -> None:
    config = mc.ModelConfig(name="m")
    assert resolve_instance_groups(config, gpu_count=0) == [Placement("cpu")]
    group = config.instance_group[0]
    assert (group.name, group.kind, group.count) == ("m_0", KIND.KIND_CPU, 1)


def test_instance_groups_default_to_every_gpu() -> None:
    config = mc.ModelConfig(name="m")
    assert resolve_instance_groups(config, gpu_count=2) == [Placement("cuda", 0), Placement("cuda", 1)]
    assert config.instance_group[0].kind == KIND.KIND_GPU
    assert list(config.instance_group[0].gpus) == [0, 1]


def test_instance_groups_counts_kinds_and_gpus() -> None:
    config = mc.ModelConfig(name="m")
    config.instance_group.add(count=2, kind=KIND.KIND_CPU)
    config.instance_group.add(count=2, kind=KIND.KIND_GPU, gpus=[1])
    assert resolve_instance_groups(config, gpu_count=2) == [
        Placement("cpu"),
        Placement("cpu"),
        Placement("cuda", 1),
        Placement("cuda", 1),
    ]


def test_gpu_groups_run_on_cpu_when_no_gpu_is_usable() -> None:
    config = mc.ModelConfig(name="m")
    config.instance_group.add(count=3, kind=KIND.KIND_GPU, gpus=[0])
    assert resolve_instance_groups(config, gpu_count=0) == [Placement("cpu")] * 3
    assert config.instance_group[0].kind == KIND.KIND_CPU and not config.instance_group[0].gpus


def test_instance_groups_reject_missing_gpus() -> None:
    config = mc.ModelConfig(name="m")
    config.instance_group.add(count=1, kind=KIND.KIND_GPU, gpus=[3])
    with pytest.raises(InvalidArgument, match=r"GPUs \[3\]"):
        resolve_instance_groups(config, gpu_count=2)


def test_stage_override_writes_a_private_model_dir(tmp_path: Path) -> None:
    staged = stage_override(tmp_path / "staging", "m", {"1/model.onnx": b"abc", "2/sub/extra.bin": b"x"})
    assert staged.parent == tmp_path / "staging"
    assert (staged / "1" / "model.onnx").read_bytes() == b"abc"
    assert (staged / "2" / "sub" / "extra.bin").read_bytes() == b"x"
    assert available_versions(staged) == [1, 2]


@pytest.mark.parametrize("bad", ["../1/model.onnx", "/etc/passwd", "1/../../x", ""])
def test_stage_override_rejects_escaping_paths(tmp_path: Path, bad: str) -> None:
    with pytest.raises(InvalidArgument, match="must be relative"):
        stage_override(tmp_path, "m", {"1/model.onnx": b"ok", bad: b"evil"})
    assert list(tmp_path.iterdir()) == []  # the half-written directory is gone


def test_datatype_tables_round_trip() -> None:
    assert wire_datatype(mc.TYPE_STRING) == "BYTES"
    assert wire_datatype(mc.TYPE_FP16) == "FP16"
    for value in mc.DataType.values():
        if value != mc.TYPE_INVALID:
            assert config_datatype(wire_datatype(value)) == value
    with pytest.raises(InvalidArgument):
        wire_datatype(mc.TYPE_INVALID)


@pytest.mark.parametrize("name", ["", "..", "a/b", "a b"])
def test_model_names_must_be_one_path_component(name: str) -> None:
    with pytest.raises(InvalidArgument):
        check_model_name(name)
