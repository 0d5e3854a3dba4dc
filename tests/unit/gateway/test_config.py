"""The config loader: settings nested per concern, the flat keys of earlier
releases still read (with one warning each), and errors that name the key."""

from __future__ import annotations

import argparse
import ast
import logging
import sys
from pathlib import Path
from typing import Any

import pytest

from gateway.config import DEPRECATED_KEYS, load_config
from gateway.settings import GROUPS, ConfigError, GatewayConfig, HedgeSettings, RetrySettings, config_keys

ROOT = Path(__file__).resolve().parents[3]


def deprecations(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "gateway.config" and "deprecated" in r.getMessage()]


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "gateway.yaml"
    path.write_text(text)
    return path


def test_nested_groups_load_into_their_records(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = write(tmp_path, "retry:\n  budget_percent: 5\n  limit: 7\nhedge: {percentile: 95, hang_min_s: 2}\n"
                           "batching:\n  mode: fixed\n  max_queue_size: 10\ncache: {size_bytes: 4096}\n"
                           "placement: {interval_s: 0.5, load_on_demand: yes}\nhost: 0.0.0.0\n")
    config = load_config(path)
    assert isinstance(config.retry, RetrySettings) and isinstance(config.hedge, HedgeSettings)
    assert (config.retry.budget_percent, config.retry.limit) == (5.0, 7)
    assert (config.hedge.percentile, config.hedge.hang_min_s) == (95.0, 2.0)
    assert (config.batching.mode, config.batching.max_queue_size) == ("fixed", 10)
    assert config.cache.size_bytes == 4096 and config.placement.load_on_demand is True
    assert config.placement.interval_s == 0.5 and config.host == "0.0.0.0"
    # Keys left out keep their defaults.
    assert config.retry.backoff_max_s == RetrySettings().backoff_max_s
    assert config.probe == GatewayConfig().probe
    assert deprecations(caplog) == []


def _sample(group: str, key: str) -> Any:
    return getattr(GROUPS[group](), key)


@pytest.mark.parametrize("old", sorted(DEPRECATED_KEYS))
def test_each_flat_key_still_works_and_warns_once_naming_its_new_key(
        old: str, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    group, key = DEPRECATED_KEYS[old]
    value = _sample(group, key)
    caplog.set_level(logging.WARNING, logger="gateway.config")
    # In the file and again as an override: still one line.
    config = load_config(write(tmp_path, f"{old}: {value!r}\n" if isinstance(value, str) else f"{old}: {value}\n"),
                         **{old: value})
    assert getattr(getattr(config, group), key) == value
    assert deprecations(caplog) == [f"config key {old!r} is deprecated: write {group}.{key}"]


def test_a_flat_key_reaches_its_new_place(caplog: pytest.LogCaptureFixture) -> None:
    config = load_config(None, retry_budget_percent=5, hedge_percentile=99, model_idle_ttl_s=30, cache_size="1024",
                         autoscale_up_rate=4, outlier_consecutive_failures=7, retry_limit=9, batching_mode="off")
    assert (config.retry.budget_percent, config.hedge.percentile, config.placement.idle_ttl_s) == (5, 99, 30)
    assert (config.cache.size_bytes, config.autoscale.up_rate, config.outlier.consecutive_failures) == (1024, 4, 7)
    assert (config.retry.limit, config.batching.mode) == (9, "off")
    assert len(deprecations(caplog)) == 8


def test_one_source_giving_both_forms_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"'retry_budget_percent' and retry.budget_percent"):
        load_config(write(tmp_path, "retry_budget_percent: 5\nretry:\n  budget_percent: 6\n"))
    with pytest.raises(ConfigError, match=r"'probe_interval_s' and probe.interval_s"):
        load_config(None, probe={"interval_s": 1}, probe_interval_s=2)


def test_a_later_source_wins_whatever_its_form(tmp_path: Path) -> None:
    path = write(tmp_path, "retry_budget_percent: 5\nprobe:\n  interval_s: 3\n")
    config = load_config(path, retry={"budget_percent": 6}, probe_interval_s=4)
    assert (config.retry.budget_percent, config.probe.interval_s) == (6, 4)


def test_overrides_merge_into_the_files_group(tmp_path: Path) -> None:
    path = write(tmp_path, "retry:\n  budget_percent: 5\n  limit: 2\n")
    config = load_config(path, retry={"limit": 4, "min_concurrency": None})
    assert (config.retry.budget_percent, config.retry.limit) == (5, 4)
    assert config.retry.min_concurrency == RetrySettings().min_concurrency


@pytest.mark.parametrize("text, named", [
    ("retry:\n  budget: 5\n", "retry.budget"),
    ("hedge:\n  hedge_percentile: 95\n", "hedge.hedge_percentile"),
    ("outlier:\n  latency_min_samples: 3\n", "outlier.latency_min_samples"),  # tuned in code, not a key
    ("security:\n  worker_token: s3cret\n", "security.worker_token"),  # secrets come from the environment only
])
def test_an_unknown_key_in_a_group_is_refused_by_name(tmp_path: Path, text: str, named: str) -> None:
    with pytest.raises(ConfigError, match=f"unknown config key '{named}'"):
        load_config(write(tmp_path, text))


def test_a_group_must_be_a_mapping(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="'retry' must be a mapping"):
        load_config(write(tmp_path, "retry: 5\n"))


@pytest.mark.parametrize("text, named", [
    ("retry: {budget_percent: lots}\n", "retry.budget_percent"),
    ("retry: {budget_percent: 101}\n", "retry.budget_percent"),
    ("probe: {interval_s: 0}\n", "probe.interval_s"),
    ("batching: {mode: sometimes}\n", "batching.mode"),
    ("placement: {worker_memory_fraction: 2}\n", "placement.worker_memory_fraction"),
    ("autoscale: {up_rate: 2, down_rate: 3}\n", "autoscale.down_rate"),
    ("membership: {heartbeat_misses_to_down: 0}\n", "membership.heartbeat_misses_to_down"),
    ("security: {tls_cert: c.pem}\n", "security.tls_cert"),
    ("placement: {load_on_demand: maybe}\n", "placement.load_on_demand"),
    ("probe_timeout_s: -1\n", "probe.timeout_s"),  # a flat key's error names its new key
])
def test_a_bad_value_names_its_group_and_key(tmp_path: Path, text: str, named: str) -> None:
    with pytest.raises(ConfigError, match=named.replace(".", r"\.")):
        load_config(write(tmp_path, text))


def test_security_paths_are_relative_to_the_file_and_secrets_stay_out_of_the_repr(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("INFERGATE_WORKER_TOKEN", "env-token-0123456789")
    config = load_config(write(tmp_path, "security:\n  tls_cert: c.pem\n  tls_key: k.pem\n"))
    assert config.security.tls_cert == str(tmp_path / "c.pem") and config.security.tls_key == str(tmp_path / "k.pem")
    assert config.security.worker_token == "env-token-0123456789"
    assert "env-token" not in repr(config)


def test_the_command_line_flags_keep_their_names_and_warn_of_nothing(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from gateway.app import add_arguments, config_from_args

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    (tmp_path / "c.pem").write_text("")
    args = parser.parse_args(["--batching", "off", "--cache-size", "2048", "--load-on-demand",
                              "--tls-cert", str(tmp_path / "c.pem"), "--tls-key", str(tmp_path / "k.pem")])
    config = config_from_args(args)
    assert (config.batching.mode, config.cache.size_bytes, config.placement.load_on_demand) == ("off", 2048, True)
    assert config.security.tls_cert == str(tmp_path / "c.pem")
    assert deprecations(caplog) == []


@pytest.mark.parametrize("path", sorted(str(p.relative_to(ROOT)) for p in (ROOT / "deploy").rglob("gateway.yaml")))
def test_the_shipped_configs_use_the_nested_keys(path: str, caplog: pytest.LogCaptureFixture) -> None:
    load_config(ROOT / path)
    assert deprecations(caplog) == []


def test_every_flat_key_points_at_a_key_of_its_group() -> None:
    """The deprecation table points only at keys the groups have."""
    for old, (group, key) in DEPRECATED_KEYS.items():
        assert key in config_keys(GROUPS[group]), old


def test_settings_import_nothing_of_the_project() -> None:
    tree = ast.parse((ROOT / "gateway" / "settings.py").read_text())
    modules = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    modules |= {node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert all(m.split(".")[0] in sys.stdlib_module_names for m in modules), modules


def test_server_name_defaults_to_infergate_and_is_read_from_file_and_flag(tmp_path: Path) -> None:
    assert load_config().server_name == "infergate"
    path = write(tmp_path, "server_name: triton\n")
    assert load_config(path).server_name == "triton"
    assert load_config(path, server_name="edge").server_name == "edge"  # the flag wins over the file
    with pytest.raises(ConfigError, match="server_name must be a non-empty string"):
        load_config(write(tmp_path, "server_name: ''\n"))
    from gateway.app import add_arguments, triton_overrides
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert triton_overrides(parser.parse_args(["--server-name", "triton"]))["server_name"] == "triton"
    assert triton_overrides(parser.parse_args([]))["server_name"] is None


def test_prefix_balance_thresholds_are_read_checked_and_reach_the_router(tmp_path: Path) -> None:
    from gateway.composition import build_router
    from gateway.fleet.cluster import Cluster
    from gateway.routing.prefix import Balance, PrefixAffinity

    default = load_config()
    assert (default.prefix_balance_abs_threshold, default.prefix_balance_rel_threshold) == (4, 1.5)
    config = load_config(write(tmp_path, "prefix_balance_abs_threshold: 64\nprefix_balance_rel_threshold: 2.0\n"))
    chooser = build_router(config, Cluster([])).chooser
    assert isinstance(chooser, PrefixAffinity) and chooser.balance == Balance(64, 2.0)
    with pytest.raises(ConfigError, match="prefix_balance_abs_threshold must be an integer >= 0"):
        load_config(write(tmp_path, "prefix_balance_abs_threshold: -1\n"))
    with pytest.raises(ConfigError, match="prefix_balance_rel_threshold must be at least 1"):
        load_config(write(tmp_path, "prefix_balance_rel_threshold: 0.5\n"))
