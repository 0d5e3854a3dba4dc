"""Worker model lifecycle where Triton's semantics are subtle: a ``specific``
version policy naming a version with no directory, a reload without ``config``
after a config override, ``file:`` overrides without ``config``, override
files the file system refuses, and loads refused while polling (a ``config``
that is not JSON, a file path holding ``..``). Fake backend from
``test_worker_manager``."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from protos.errors import InvalidArgument
from tests.unit.execution.test_worker_manager import CONFIG, CONFIG_JSON, FakeBackend, make_repo, request, result
from execution.manager import ModelManager
from execution.repository import ModelRepository, missing_versions, select_versions
from tritonclient.grpc import model_config_pb2 as mc


@pytest.fixture
async def manager(tmp_path: Path) -> ModelManager:
    manager = ModelManager(ModelRepository(make_repo(tmp_path)), FakeBackend(), staging_root=tmp_path / "staging")
    yield manager
    await manager.close()


def test_specific_policy_loads_the_versions_that_exist() -> None:
    config = mc.ModelConfig(name="m")
    config.version_policy.specific.versions.extend([1, 3])
    assert select_versions(config, [2, 3]) == [3]
    assert list(missing_versions(config, [2, 3])) == [1]
    assert "version directory is not present" in missing_versions(config, [2, 3])[1]
    with pytest.raises(InvalidArgument, match=r"none of them has a version directory"):
        select_versions(config, [2])


async def test_specific_policy_reports_the_missing_version_unavailable(manager: ModelManager, tmp_path: Path) -> None:
    model = tmp_path / "repo" / "m"
    (model / "1" / "model.bin").rename(model / "model.bin.tmp")
    (model / "1").rmdir()
    (model / "3").mkdir()
    (model / "model.bin.tmp").rename(model / "3" / "model.bin")
    (model / "config.pbtxt").write_text(CONFIG % 1 + "version_policy { specific { versions: [1, 3] } }\n")
    await manager.load("m")
    assert manager.is_ready("m", "3") and not manager.is_ready("m", "1")
    rows = [(r.version, r.state, r.reason) for r in await manager.index()]
    assert rows[0] == ("3", "READY", "")
    assert rows[1][:2] == ("1", "UNAVAILABLE") and "version directory is not present" in rows[1][2]
    assert [r.version for r in await manager.index(ready_only=True)] == ["3"]
    await manager.unload("m")
    assert [(r.version, r.state) for r in await manager.index()] == [("", "UNAVAILABLE")]


async def test_reload_without_config_keeps_the_config_override(manager: ModelManager) -> None:
    await manager.load("m")
    assert manager.get("m").config.max_batch_size == 4
    await manager.load("m", config_json=CONFIG_JSON.replace('"max_batch_size": 4', '"max_batch_size": 8'))
    assert manager.get("m").config.max_batch_size == 8
    await manager.load("m")  # no config: Triton keeps the override
    assert manager.get("m").config.max_batch_size == 8
    await manager.unload("m")
    await manager.load("m")  # unloaded in between: the repository's config again
    assert manager.get("m").config.max_batch_size == 4


async def test_file_override_without_config_is_refused(manager: ModelManager) -> None:
    with pytest.raises(InvalidArgument, match="Load parameter 'config' must be specified for model file override"):
        await manager.load("m", files={"1/model.bin": b"3"})
    assert not manager.is_ready("m")


async def test_reload_without_parameters_undoes_a_file_override(manager: ModelManager) -> None:
    await manager.load("m", config_json=CONFIG_JSON, files={"1/model.bin": b"3"})
    np.testing.assert_array_equal(result(await manager.get("m").infer(request())), [0.0, 3.0])
    await manager.load("m")
    np.testing.assert_array_equal(result(await manager.get("m").infer(request())), [0.0, 2.0])


async def test_an_override_file_name_the_file_system_refuses_is_a_clear_error(manager: ModelManager,
                                                                               tmp_path: Path) -> None:
    name = "x" * 256
    with pytest.raises(InvalidArgument, match=rf"cannot write override file '1/{name}' for model 'm': File name too long"):
        await manager.load("m", config_json=CONFIG_JSON, files={f"1/{name}": b"3", "1/model.bin": b"3"})
    assert list((tmp_path / "staging").iterdir()) == []


POLL_FAILED = "failed to load 'fresh', failed to poll from model repository: "


async def test_a_config_that_is_not_json_is_tritons_poll_failure(manager: ModelManager, tmp_path: Path) -> None:
    # Triton's simple_http_model_control / simple_grpc_model_control look for "failed to load".
    with pytest.raises(InvalidArgument) as info:
        await manager.load("fresh", config_json='{{"max_batch_size": "16"}}', files={"1/model.bin": b"3"})
    assert info.value.message.startswith(POLL_FAILED + "'config' parameter for model 'fresh' is not a valid ModelConfig")
    assert "fresh" not in {r.name for r in await manager.index()}  # as in Triton, no state is left
    assert list((tmp_path / "staging").iterdir()) == []


async def test_an_override_path_with_dot_dot_is_tritons_poll_failure(manager: ModelManager, tmp_path: Path) -> None:
    # Triton's test_file_override_security looks for "failed to load".
    with pytest.raises(InvalidArgument) as info:
        await manager.load("fresh", config_json=CONFIG_JSON, files={"../../escape/model.bin": b"3"})
    assert info.value.message.startswith(POLL_FAILED + "override file path '../../escape/model.bin'")
    assert "fresh" not in {r.name for r in await manager.index()}
    assert not (tmp_path / "escape").exists()


async def test_a_failed_reload_while_polling_leaves_the_loaded_versions_serving(manager: ModelManager) -> None:
    await manager.load("m")
    with pytest.raises(InvalidArgument, match="^failed to load 'm', failed to poll from model repository: "):
        await manager.load("m", config_json="{not json")
    assert manager.is_ready("m")
