"""The `models:` list: strict per-model structs, inheritance from the top level, errors that
name the model and the field, the PDGATE_MODELS overlay and the --models flag."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdgate.router.cli import config_from_args
from pdgate.router.config import ConfigError, load_config
from pdgate.router.config_checks import model_configs, validate_config
from pdgate.router.policies import POLICY_NAMES

TWO = """
decode_policy: power-of-two
disagg_min_tokens: 32
models:
  - model: org/big
    served_model_name: [big, big-alias]
    prefill: [http://p1:8000]
    decode: [http://d1:8000]
    pd_mode: push
    prefill_policy: {type: prefix-aware, params: {}}
  - model: small
    decode: [http://d2:8000, http://d1:8000]
    pd_mode: colocated
    disagg_min_tokens: 0
    early_first_token: false
    load_on_demand: true
"""


def load(tmp_path: Path, text: str) -> list:  # type: ignore[type-arg]
    path = tmp_path / "router.yaml"
    path.write_text(text)
    return model_configs(validate_config(load_config(path), POLICY_NAMES))


def test_each_model_gets_its_own_settings_over_the_top_level(tmp_path: Path) -> None:
    big, small = load(tmp_path, TWO)
    assert (big.model, big.served_names, big.pd_mode, big.prefill, big.decode) == (
        "org/big", ["big", "big-alias"], "push", ["http://p1:8000"], ["http://d1:8000"])
    assert big.engine_model == "big" and big.decode_policy == "power-of-two"
    assert big.disagg_min_tokens == 32 and big.early_first_token is True
    assert not isinstance(big.prefill_policy, str) and big.prefill_policy.type == "prefix-aware"
    assert (small.served_names, small.pd_mode, small.prefill) == (["small"], "colocated", [])
    assert small.disagg_min_tokens == 0 and small.early_first_token is False
    assert small.load_on_demand and not big.load_on_demand
    assert small.models == [] and big.models == []  # each is a one-model config


@pytest.mark.parametrize(("text", "message"), [
    ("models:\n - model: a\n   decode: [http://d:1]\n   pd_mode: pul\n",
     "models[0] (a): pd_mode: Invalid enum value 'pul'"),
    ("models:\n - model: a\n   decodes: [http://d:1]\n",
     "models[0] (a): unknown field `decodes`"),
    ("models:\n - decode: [http://d:1]\n", "models[0]: missing required field `model`"),
    ("models:\n - model: a\n   decode: [http://d:1]\n   prefill: [http://p:1]\n"
     " - model: b\n   decode: [http://d:2]\n",
     "models[1] (b): prefill: at least one prefill engine URL is required"),
    ("models:\n - model: a\n   decode: [http://d:1]\n   pd_mode: colocated\n"
     "   prefill: [http://p:1]\n",
     "models[0] (a): prefill: a colocated model has no prefill engines"),
    ("models:\n - model: a\n   decode: [http://d:1]\n   pd_mode: colocated\n"
     " - model: b\n   served_model_name: [a]\n   decode: [http://d:1]\n   pd_mode: colocated\n",
     "models[1] (b): served_model_name: 'a' is already served by models[0] (a)"),
    ("models:\n - model: a\n   decode: [http://d:1]\n   pd_mode: colocated\n"
     "   decode_policy: nope\n", "models[0] (a): decode_policy: unknown policy 'nope'"),
    ("model: top\nmodels:\n - model: a\n   decode: [http://d:1]\n   pd_mode: colocated\n",
     "model: set it under each of `models`"),
    ("decode: [http://d:1]\nmodels:\n - model: a\n   decode: [http://d:1]\n"
     "   pd_mode: colocated\n", "decode: set it under each of `models`"),
])
def test_errors_name_the_model_and_the_field(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("(", r"\(")
                       .replace(")", r"\)").replace("]", r"\]")):
        load(tmp_path, text)


def test_one_model_flags_stay_the_shorthand() -> None:
    config = config_from_args(["--model", "m", "--prefill", "http://p:1", "--decode",
                               "http://d:1"])
    [only] = model_configs(validate_config(config, POLICY_NAMES))
    assert only is config and only.served_names == ["m"]


def test_models_from_the_environment_and_the_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    models = [{"model": "a", "decode": ["http://d:1"], "pd_mode": "colocated"},
              {"model": "b", "prefill": ["http://p:2"], "decode": ["http://d:2"]}]
    monkeypatch.setenv("PDGATE_MODELS", json.dumps(models))
    names = [c.model for c in model_configs(config_from_args([]))]
    assert names == ["a", "b"]
    monkeypatch.delenv("PDGATE_MODELS")
    flag = config_from_args(["--models", json.dumps(models[:1])])
    assert [c.pd_mode for c in model_configs(flag)] == ["colocated"]
    monkeypatch.setenv("PDGATE_MODELS", "[{not json")
    with pytest.raises(ConfigError, match="PDGATE_MODELS: invalid JSON"):
        config_from_args([])


def test_k8s_discovery_finds_each_models_pods_by_their_labels(tmp_path: Path) -> None:
    text = ("discovery: k8s\nk8s_api_url: http://api:8080\nmodels:\n"
            " - model: org/big\n   served_model_name: [big]\n"
            " - model: small\n   pd_mode: colocated\n   decode_selector: app=mine\n"
            " - model: org/odd\n   pd_mode: colocated\n")
    with pytest.raises(ConfigError, match=r"models\[2\] \(org/odd\): decode_selector: a label "
                       "selector is required"):
        load(tmp_path, text)
    big, small = load(tmp_path, text.rsplit(" - model: org/odd", 1)[0])
    assert big.prefill_selector == "pdgate.io/role=prefill,pdgate.io/model=big"
    assert big.decode_selector == "pdgate.io/role=decode,pdgate.io/model=big"
    assert small.decode_selector == "app=mine"
