"""Session fixtures shared by every test package: the tiny model is built once per run."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdgate.engine_shim.tiny import ensure_tiny_model


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """HF-format directory with the tiny tokenizer, config and random weights."""
    return ensure_tiny_model(tmp_path_factory.mktemp("models") / "tiny")
