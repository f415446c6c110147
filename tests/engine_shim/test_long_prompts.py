"""Prompts too long to fit are refused before they are tokenized (`common/char_bound.py`,
the router's rule), so a shim reached directly (by pdgate's own legs or anyone with the key)
does not spend seconds and a gigabyte on them.

Real `python -m pdgate.engine_shim` processes on 127.0.0.1; the tiny model's longest token
covers 12 characters, so a 4 MB prompt is at least ~350k tokens against a 16k context."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from tests.engine_shim.process import MODEL, shim_process

PROMPT_BYTES = 4 << 20
MAX_GROWTH = 100 << 20


def _big_prompt(seed: int) -> str:
    words = [f"w{seed}x{i % 997} " for i in range(PROMPT_BYTES // 8)]
    return "".join(words)[:PROMPT_BYTES]


def test_three_4mb_prompts_are_refused_early_with_bounded_memory(tiny_model_dir: Path) -> None:
    with shim_process(tiny_model_dir, "--no-kv-transfer") as shim:
        warm = httpx.post(shim.url + "/v1/completions", timeout=60, json={
            "model": MODEL, "prompt": "Hello there", "max_tokens": 2})
        assert warm.status_code == 200, warm.text
        before = shim.rss_bytes()
        bodies = [
            {"model": MODEL, "prompt": _big_prompt(0), "max_tokens": 4},
            {"model": MODEL, "prompt": _big_prompt(1)},
            {"model": MODEL, "max_tokens": 4,
             "messages": [{"role": "user", "content": _big_prompt(2)}]},
        ]
        paths = ["/v1/completions", "/v1/completions", "/v1/chat/completions"]
        with ThreadPoolExecutor(3) as pool:
            replies = list(pool.map(
                lambda pb: httpx.post(shim.url + pb[0], json=pb[1], timeout=120),
                zip(paths, bodies, strict=True)))
        growth = shim.rss_bytes() - before
        assert growth < MAX_GROWTH, f"RSS grew {growth / 2**20:.0f} MiB"
        for r in replies:
            assert r.status_code == 400, r.text[:300]
            err = r.json()["error"]
            assert err["type"] == "BadRequestError" and err["code"] == 400
            assert "maximum context length is" in err["message"]
            assert "at least" in err["message"] and "characters" in err["message"]
        # Still serving.
        ok = httpx.post(shim.url + "/v1/completions", timeout=60, json={
            "model": MODEL, "prompt": "Hello again", "max_tokens": 2})
        assert ok.status_code == 200, ok.text


def test_a_prompt_that_fits_by_length_is_still_tokenized(tiny_model_dir: Path) -> None:
    """Just under the character bound (max_model_len tokens at most 12 characters each)
    the prompt is tokenized, then refused by its token count, or served."""
    with shim_process(tiny_model_dir, "--no-kv-transfer", "--max-model-len", "64") as shim:
        r = httpx.post(shim.url + "/v1/completions", timeout=60, json={
            "model": MODEL, "prompt": "ab " * 200, "max_tokens": 4})
        assert r.status_code == 400
        assert "in the prompt" in r.json()["error"]["message"]  # counted, not bounded
        r = httpx.post(shim.url + "/v1/completions", timeout=60, json={
            "model": MODEL, "prompt": "ab " * 10, "max_tokens": 4})
        assert r.status_code == 200, r.text
