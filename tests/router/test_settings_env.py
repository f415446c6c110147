"""Every router setting can come from `PDGATE_<FIELD>` (secrets also from `*_FILE`), and
what the environment sets is what the running router enforces."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from pdgate.router.cli import config_from_args
from pdgate.router.config import ConfigError, RouterConfig
from pdgate.router.settings_env import env_name, env_overrides, env_reference

BASE = ["--model", "m", "--prefill", "http://p:1", "--decode", "http://d:1"]


def test_every_field_has_a_variable() -> None:
    names = {field for _, field in env_reference()}
    assert names == {f.name for f in msgspec.structs.fields(RouterConfig)}
    assert ("PDGATE_API_KEYS_FILE", "api_keys") in env_reference()


def test_values_are_converted_per_field_type(monkeypatch: pytest.MonkeyPatch) -> None:
    env = {"PDGATE_PD_MODE": "notify", "PDGATE_PORT": "9001", "PDGATE_KV_READY_TIMEOUT_S": "2.5",
           "PDGATE_EARLY_FIRST_TOKEN": "false", "PDGATE_API_KEYS": "sk-aaaaaaaa, sk-bbbbbbbb",
           "PDGATE_MAX_MODEL_LEN": "4096", "PDGATE_DISAGG_PREFIX_RATIO": "0.5",
           "PDGATE_PREFILL_POLICY": '{"type": "prefix-aware", "params": {}}',
           "PDGATE_NOTIFY_ADVERTISE_HOST": "10.1.2.3", "PDGATE_UNRELATED": "x"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    c = config_from_args(BASE)
    assert (c.pd_mode, c.port, c.kv_ready_timeout_s, c.early_first_token) == \
        ("notify", 9001, 2.5, False)
    assert c.api_keys == ["sk-aaaaaaaa", "sk-bbbbbbbb"] and c.max_model_len == 4096
    assert c.disagg_prefix_ratio == 0.5 and c.notify_advertise_host == "10.1.2.3"
    assert not isinstance(c.prefill_policy, str) and c.prefill_policy.type == "prefix-aware"


def test_flags_beat_env_and_env_beats_yaml(tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    yaml = tmp_path / "c.yaml"
    yaml.write_text("port: 7000\nmax_retries: 4\nhealth_interval_s: 9\n")
    monkeypatch.setenv("PDGATE_PORT", "7100")
    monkeypatch.setenv("PDGATE_MAX_RETRIES", "2")
    c = config_from_args([*BASE, "--config", str(yaml), "--port", "7200"])
    assert (c.port, c.max_retries, c.health_interval_s) == (7200, 2, 9)


def test_secrets_from_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "keys").write_text("sk-file-key-1,sk-file-key-2\n")
    (tmp_path / "engine").write_text("sk-engine-key\n")
    monkeypatch.setenv("PDGATE_API_KEYS_FILE", str(tmp_path / "keys"))
    monkeypatch.setenv("PDGATE_ENGINE_API_KEY_FILE", str(tmp_path / "engine"))
    c = config_from_args(BASE)
    assert c.api_keys == ["sk-file-key-1", "sk-file-key-2"]
    assert c.engine_api_key == "sk-engine-key"  # the mount's trailing newline is not the key


@pytest.mark.parametrize(("env", "message"), [
    ({"PDGATE_PORT": "eighty"}, "PDGATE_PORT"),
    ({"PDGATE_EARLY_FIRST_TOKEN": "maybe"}, "PDGATE_EARLY_FIRST_TOKEN"),
    ({"PDGATE_API_KEY_FILE": "/nonexistent/key"}, "PDGATE_API_KEY_FILE"),
    ({"PDGATE_API_KEY": "sk-x-12345", "PDGATE_API_KEY_FILE": "/etc/hostname"}, "both"),
])
def test_bad_values_name_the_variable(env: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        env_overrides(env)


def test_env_name() -> None:
    assert env_name("notify_secret") == "PDGATE_NOTIFY_SECRET"
