"""Router tokenization matches the HF tokenizer, and the router never imports torch."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from transformers import PreTrainedTokenizerFast

from pdgate.router.errors import InvalidRequest
from pdgate.router.input.tokenization import THREAD_THRESHOLD_CHARS, PromptTokenizer


@pytest.fixture(scope="module")
def hf(tiny_model_dir: Path) -> Any:
    return PreTrainedTokenizerFast.from_pretrained(str(tiny_model_dir))


async def test_prompt_ids_match_hf(tokenizer: PromptTokenizer, hf: Any
                                   ) -> None:
    for text in ("Hello world", "The quick brown fox " * 200):
        ids = await tokenizer.encode_prompt(text)
        assert ids == hf(text)["input_ids"]
        assert ids[0] == 1  # BOS added like the engine does
    assert len("The quick brown fox " * 200) > THREAD_THRESHOLD_CHARS  # thread path ran


async def test_chat_ids_match_hf_template(
    tokenizer: PromptTokenizer, hf: Any
) -> None:
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "What is the capital of France?"}]
    ids = await tokenizer.encode_chat(messages)
    expected: Any = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    expected_ids = expected["input_ids"] if hasattr(expected, "keys") else expected
    assert ids == list(expected_ids)
    parts = [{"role": "user", "content": [{"type": "text", "text": "What is the capital"},
                                          {"type": "text", "text": "of France?"}]}]
    joined = [{"role": "user", "content": "What is the capital\nof France?"}]
    assert await tokenizer.encode_chat(parts) == await tokenizer.encode_chat(joined)


async def test_template_error_is_a_client_error(tokenizer: PromptTokenizer) -> None:
    with pytest.raises(InvalidRequest) as info:
        await tokenizer.encode_chat(
            [{"role": "user", "content": "x"}],
            template_kwargs={"chat_template": "{{ raise_exception('no') }}"},
        )
    assert info.value.status == 400


def test_max_model_len_from_model_config(tokenizer: PromptTokenizer) -> None:
    assert tokenizer.max_model_len == 4096


def test_router_never_imports_torch(tiny_model_dir: Path) -> None:
    code = (
        "import sys\n"
        "from pdgate.router.http.app import create_app\n"
        "from pdgate.router.cli import main\n"
        "from pdgate.router.input.tokenization import load_tokenizer\n"
        f"load_tokenizer({str(tiny_model_dir)!r}, {str(tiny_model_dir)!r}, None)\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
        "shim = [m for m in sys.modules if m.split('.')[:2] == ['pdgate', 'engine_shim']]\n"
        "assert not shim and 'engine_shim' not in sys.modules, shim\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[2])
