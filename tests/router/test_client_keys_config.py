"""`client_keys`, `admission_order` and `forward_priority` as settings: YAML, env (the keys
from a secret file), flags; errors that name the entry, never the key."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdgate.router.cli import config_from_args
from pdgate.router.config import ClientKey, ConfigError, RouterConfig, load_config
from pdgate.router.config_checks import model_configs, validate_config
from pdgate.router.policies import POLICIES

NAMES = frozenset(POLICIES)
BASE = ["--model", "m", "--prefill", "http://p:1", "--decode", "http://d:1"]
GOLD = {"key": "sk-gold-secret-1", "name": "gold", "priority": -1, "tokens_per_minute": 900}


def test_client_keys_from_yaml_are_accepted_keys(tmp_path: Path) -> None:
    path = tmp_path / "r.yaml"
    path.write_text("model: m\nprefill: [http://p:1]\ndecode: [http://d:1]\n"
                    "admission_order: fifo\nforward_priority: true\n"
                    "client_keys:\n  - {key: sk-gold-secret-1, name: gold, priority: -1,"
                    " tokens_per_minute: 900}\n  - {key: sk-free-secret-2, name: free}\n")
    config = validate_config(load_config(path), NAMES)
    assert config.client_keys == [ClientKey(**GOLD),  # type: ignore[arg-type]
                                  ClientKey(key="sk-free-secret-2", name="free")]
    assert config.client_api_keys == ["sk-gold-secret-1", "sk-free-secret-2"]
    assert (config.admission_order, config.forward_priority) == ("fifo", True)


def test_client_keys_from_a_secret_file_and_flags(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "keys.json").write_text(json.dumps([GOLD]) + "\n")
    monkeypatch.setenv("PDGATE_CLIENT_KEYS_FILE", str(tmp_path / "keys.json"))
    config = config_from_args([*BASE, "--admission-order", "fifo", "--forward-priority"])
    assert config.client_keys == [ClientKey(**GOLD)]  # type: ignore[arg-type]
    assert (config.admission_order, config.forward_priority) == ("fifo", True)


def test_bad_client_keys_json_does_not_echo_the_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDGATE_CLIENT_KEYS", '[{"key": "sk-gold-secret-1", "name": ')
    with pytest.raises(ConfigError) as info:
        config_from_args(BASE)
    assert "PDGATE_CLIENT_KEYS" in str(info.value)
    assert "sk-gold-secret-1" not in str(info.value)


@pytest.mark.parametrize(("entries", "message"), [
    ([{**GOLD, "key": "short"}], "client_keys[0]: key: use at least 8 characters"),
    ([GOLD, {**GOLD, "name": "other"}], "client_keys[1] (other): key: the same key"),
    ([GOLD, {**GOLD, "key": "sk-other-secret"}], "client_keys[1]: name: 'gold' must be "
                                                 "unique"),
    ([{**GOLD, "name": "has space"}], "client_keys[0]: name: 'has space'"),
    ([{**GOLD, "tokens_per_minute": 0}], "client_keys[0] (gold): tokens_per_minute: must "
                                         "be > 0"),
    ([{**GOLD, "priority": 2**40}], "client_keys[0] (gold): priority: must be in"),
])
def test_bad_client_keys_name_the_entry_not_the_key(
        entries: list[dict[str, object]], message: str) -> None:
    config = RouterConfig(model="m", prefill=["http://p:1"], decode=["http://d:1"],
                          client_keys=[ClientKey(**e)  # type: ignore[arg-type]
                                                  for e in entries])
    with pytest.raises(ConfigError) as info:
        validate_config(config, NAMES)
    assert str(info.value).startswith(message)
    assert "secret" not in str(info.value)


def test_a_key_of_api_keys_cannot_be_given_settings_twice() -> None:
    config = RouterConfig(model="m", prefill=["http://p:1"], decode=["http://d:1"],
                          api_keys=["sk-gold-secret-1"],
                          client_keys=[ClientKey(**GOLD)])  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="client_keys\\[0\\] \\(gold\\): key: the same"):
        validate_config(config, NAMES)


def test_forward_priority_per_model(tmp_path: Path) -> None:
    path = tmp_path / "r.yaml"
    engines = "prefill: [http://p:1], decode: [http://d:1]"
    path.write_text(f"models:\n  - {{model: a, forward_priority: true, {engines}}}\n"
                    f"  - {{model: b, {engines}}}\n")
    a, b = model_configs(validate_config(load_config(path), NAMES))
    assert (a.forward_priority, b.forward_priority) == (True, False)
