"""Renders of the chart shared by the deploy tests (the renderer is built once per run)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.deploy.helm_render import CHART, Rendered, Renderer, build

MONITORING = ("monitoring.coreos.com/v1",)
VLLM_VALUES = CHART / "values-vllm.yaml"
VLLM_PUSH_VALUES = CHART / "values-vllm-push.yaml"  # on top of VLLM_VALUES
# Default values plus what a secured notify-mode release sets: client keys, notify mode.
NOTIFY_OVERRIDES: dict[str, Any] = {
    "router": {"pdMode": "notify"},
    "apiKeys": {"keys": ["client-key-one-0001", "client-key-two-0002"]},
}


def write_values(tmp_path: Path, overrides: dict[str, Any], name: str = "values.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(overrides))
    return path


@pytest.fixture(scope="session")
def renderer(tmp_path_factory: pytest.TempPathFactory) -> Renderer:
    return Renderer(build(tmp_path_factory.mktemp("helmrender")))


@pytest.fixture(scope="session")
def default(renderer: Renderer) -> Rendered:
    return renderer.render()


@pytest.fixture(scope="session")
def vllm(renderer: Renderer) -> Rendered:
    return renderer.render(VLLM_VALUES, api_versions=MONITORING)


@pytest.fixture(scope="session")
def vllm_push(renderer: Renderer) -> Rendered:
    return renderer.render(VLLM_VALUES, VLLM_PUSH_VALUES, api_versions=MONITORING)


@pytest.fixture(scope="session")
def notify(renderer: Renderer, tmp_path_factory: pytest.TempPathFactory) -> Rendered:
    return renderer.render(write_values(tmp_path_factory.mktemp("values"), NOTIFY_OVERRIDES))
