"""The real-vLLM suite (make test-vllm)."""

import pytest

# Helper modules assert too: rewritten, their failures show the values compared.
pytest.register_assert_rewrite("tests.vllm.tool_calls", "tests.vllm.recording")
