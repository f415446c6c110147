"""Unit tests of the hostile-input bounds: JSON depth, the template sandbox and workers,
the model's own template rendered like transformers, the prompt character bound."""

from __future__ import annotations

import json
import math
import time
import unicodedata
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers
from transformers import PreTrainedTokenizerFast

import pdgate.router.input.template_workers as workers_module
from pdgate.router.errors import InvalidRequest
from pdgate.router.input.limits import InputLimits, check_json_depth
from pdgate.router.input.template_sandbox import BoundedEnvironment, render_bounded
from pdgate.router.input.tokenization import PromptTokenizer, max_chars_per_token
from tests.router.test_hostile_requests import HI, nested_arrays, nested_objects


def test_depth_is_counted_outside_strings_only() -> None:
    for exactly_32 in (nested_arrays(32), nested_objects(32),
                       b'[{"a": ' * 16 + b"1" + b"}]" * 16):
        check_json_depth(exactly_32, 32)
        with pytest.raises(InvalidRequest, match="deeper than 32"):
            check_json_depth(b"[" + exactly_32 + b"]", 32)
    brackets_in_text = json.dumps({"prompt": "[{" * 5000 + "\\\"[" * 100}).encode()
    check_json_depth(brackets_in_text, 32)
    escaped_quote = b'{"prompt": "\\"' + b"[" * 100 + b'"}'  # still inside the string
    check_json_depth(escaped_quote, 32)
    escaped_backslash = b'{"prompt": "\\\\", "x": ' + nested_arrays(40) + b"}"
    with pytest.raises(InvalidRequest):  # the string ended: these brackets are real
        check_json_depth(escaped_backslash, 32)
    check_json_depth(b"[" + b"[]," * 100_000 + b"[]]", 32)  # wide, not deep


def _depth(value: Any) -> int:
    if isinstance(value, list):
        return 1 + max(map(_depth, value), default=0)
    if isinstance(value, dict):
        return 1 + max(map(_depth, value.values()), default=0)
    return 0


_tricky = st.text(alphabet='[]{}"\\ab\n', max_size=6)  # brackets, quotes, escapes in text
json_trees = st.recursive(
    st.none() | st.integers() | _tricky,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_tricky, inner, max_size=3),
    max_leaves=40)


@settings(max_examples=300, deadline=None)
@given(tree=json_trees, limit=st.integers(1, 6), compact=st.booleans())
def test_depth_check_agrees_with_the_decoded_depth(tree: Any, limit: int,
                                                   compact: bool) -> None:
    raw = (json.dumps(tree, separators=(",", ":")) if compact else json.dumps(tree)).encode()
    try:
        check_json_depth(raw, limit)
        refused = False
    except InvalidRequest:
        refused = True
    assert refused == (_depth(tree) > limit)


async def test_lone_surrogates_never_crash_the_tokenizer(tokenizer: PromptTokenizer) -> None:
    # msgspec refuses them in bodies; a template can still produce one (`'%c' % 55296`).
    with pytest.raises(InvalidRequest, match="lone surrogate"):
        await tokenizer.encode_prompt("a\ud800b")
    with pytest.raises(InvalidRequest, match="lone surrogate"):
        await tokenizer.encode_prompt("x" * 5000 + "\udfff")  # the worker-thread path


SANDBOX_BOMBS = {
    "nested loops": "{% for a in range(100000) %}{% for b in range(100000) %}"
                    "{% endfor %}{% endfor %}",
    "recursive fan-out": "{% macro f(n) %}{% if n %}{{ f(n-1) }}{{ f(n-1) }}{% endif %}"
                         "{% endmacro %}{{ f(40) }}",
    "repeat": "{{ 'x' * 100000000 }}",
    "doubling ~": "{% set ns = namespace(s='x') %}{% for i in range(64) %}"
                  "{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
    "doubling +": "{% set ns = namespace(s='x') %}{% for i in range(64) %}"
                  "{% set ns.s = ns.s + ns.s %}{% endfor %}",
    "set block": "{% set x %}{% for i in range(100000) %}{% for j in range(1000) %}"
                 "xxxxxxxxxx{% endfor %}{% endfor %}{% endset %}",
    "macro buffer": "{% macro m() %}{% for i in range(100000) %}{{ 'x' * 1000 }}"
                    "{% endfor %}{% endmacro %}{{ m()|length }}",
    "printed list of refs": "{% set s = 'x' * 1000000 %}{{ [s] * 1000 }}",
    "join": "{% set s = 'x' * 1000000 %}{{ ([s, s, s])|join(s) }}",
    "center": "{{ 'x'|center(1000000000) }}",
    "ljust": "{{ 'x'.ljust(1000000000) }}",
    "format width": "{{ '{:>1000000000}'.format(1) }}",
    "percent width": "{{ '%1000000000d' % 1 }}",
    "power": "{{ 10 ** 100000000 }}",
    "squaring": "{% set ns = namespace(x=3) %}{% for i in range(40) %}"
                "{% set ns.x = ns.x * ns.x %}{% endfor %}",
    "indent": "{% set s = '\\n' * 1000000 %}{{ s|indent(1000) }}",
    "replace": "{% set s = 'a' * 1000000 %}{{ s|replace('a', 'bbbbbbbbbb') }}",
    "expandtabs": "{% set s = '\\t' * 1000000 %}{{ s.expandtabs(100) }}",
    "tojson indent": "{{ messages|tojson(indent=100000) }}",
    "kept values": "{% set s = 'x' * 1000000 %}{% for i in range(1000) %}"
                   "{% set y = s ~ i %}{% endfor %}",
    "dict of refs": "{{ dict.fromkeys(range(100000), 'x' * 1000000) }}",
    "lone surrogate": "{{ '\\ud800' }}",
    "recursion": "{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}",
    "lipsum": "{{ lipsum(100000) }}",
}


@pytest.mark.parametrize("bomb", list(SANDBOX_BOMBS), ids=list(SANDBOX_BOMBS))
def test_sandbox_stops_template_bombs_by_itself(bomb: str) -> None:
    env = BoundedEnvironment()
    t0 = time.perf_counter()
    with pytest.raises(InvalidRequest):
        render_bounded(env, SANDBOX_BOMBS[bomb], {"messages": HI}, timeout_s=0.3,
                       max_chars=4 * 1024 * 1024)
    # refused at once or stopped at its 0.3 s budget (the margin is for a loaded CI machine)
    assert time.perf_counter() - t0 < 0.3 + 2.0


async def test_template_worker_is_killed_when_it_does_not_stop(
    tokenizer: PromptTokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    tok = tokenizer.with_limits(InputLimits(allow_client_chat_template=True,
                                            chat_template_timeout_s=0.5))
    assert tok._workers is not None
    try:
        assert await tok.render_chat(HI, chat_template="{{ 1 }}") == "1"  # worker started
        (first,) = tok._workers._all
        # The parent stops waiting before the worker gives up by itself: it kills it.
        monkeypatch.setattr(workers_module, "_KILL_GRACE_S", -0.4)
        t0 = time.perf_counter()
        with pytest.raises(InvalidRequest, match="took longer than 0.5 s"):
            await tok.render_chat(HI, chat_template=SANDBOX_BOMBS["nested loops"])
        assert time.perf_counter() - t0 < 1.0
        assert first.proc.returncode == -9 and first not in tok._workers._all
        monkeypatch.setattr(workers_module, "_KILL_GRACE_S", 0.5)
        assert await tok.render_chat(HI, chat_template="{{ 2 }}") == "2"  # a new worker
    finally:
        await tok.aclose()


async def test_template_workers_run_where_the_router_is_installed(
    tokenizer: PromptTokenizer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A router started from any directory (as an installed `pdgate` is) renders client
    templates: its workers import the installed package, not this checkout's folders."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("PYTHONPATH", raising=False)
    tok = tokenizer.with_limits(InputLimits(allow_client_chat_template=True))
    try:
        assert await tok.render_chat(HI, chat_template="{{ 6 * 7 }}") == "42"
    finally:
        await tok.aclose()


async def test_template_worker_memory_is_capped(tokenizer: PromptTokenizer) -> None:
    tok = tokenizer.with_limits(InputLimits(allow_client_chat_template=True))
    assert tok._workers is not None
    tok._workers._memory_bytes = 8 * 1024 * 1024  # headroom over the worker's own size
    lists = "{% set a = range(100000)|list %}{% set b = range(100000)|list %}" * 4
    try:
        with pytest.raises(InvalidRequest, match="out of memory"):
            await tok.render_chat(HI, chat_template=lists + "{{ a|length }}")
        assert await tok.render_chat(HI, chat_template="{{ 3 }}") == "3"  # a new worker
    finally:
        await tok.aclose()


# The model's own template, rendered by the router instead of apply_chat_template: the
# same text for the same variables.
TOOL_TEMPLATE = (
    "{%- set ns = namespace(first=true) -%}"
    "{%- if tools %}<tools>{{ tools | tojson(indent=2) }}</tools>\n{% endif -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'system' and not ns.first %}{{ raise_exception('system first') }}"
    "{% endif -%}{% set ns.first = false %}"
    "{%- if m.role == 'assistant' %}{% generation %}{{ m.content }}{% endgeneration %}"
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content | trim }}<|im_end|>\n{% endif -%}"
    "{%- if loop.index > 50 %}{% break %}{% endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif -%}"
    "{{ bos_token if greet is defined else '' }}{{ documents | length if documents else '' }}"
)


@pytest.mark.parametrize("kwargs", [
    {}, {"greet": True}, {"tools": [{"type": "function", "function": {"name": "f"}}]},
    {"documents": [{"title": "t", "text": "x"}]},
    {"continue_final_message": True, "add_generation_prompt": False},
])
async def test_own_template_renders_like_transformers(
    tokenizer: PromptTokenizer, tiny_model_dir: Path, kwargs: dict[str, Any]
) -> None:
    hf = PreTrainedTokenizerFast.from_pretrained(str(tiny_model_dir))
    hf.chat_template = TOOL_TEMPLATE
    tok = PromptTokenizer(hf, 4096)
    messages: list[dict[str, Any]] = [{"role": "system", "content": " Be brief. "},
                {"role": "user", "content": "Hi", "name": None},
                {"role": "assistant", "content": "Hello"}]
    expected = hf.apply_chat_template(messages, tokenize=False,
                                      **{"add_generation_prompt": True, **kwargs})
    assert await tok.render_chat(messages, template_kwargs=kwargs) == expected



def test_char_bound_is_the_longest_token(tokenizer: PromptTokenizer) -> None:
    vocab = tokenizer._backend.get_vocab(with_added_tokens=True)
    assert tokenizer.max_chars_per_token == max(len(t) for t in vocab)
    assert tokenizer.char_limit(96) == (4096 - 96) * tokenizer.max_chars_per_token


@settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
@given(text=st.text(max_size=300) | st.text(alphabet="ab <|>im_startend\n", max_size=300))
def test_char_bound_never_refuses_a_prompt_that_fits(
    tokenizer: PromptTokenizer, text: str
) -> None:
    cpt = tokenizer.max_chars_per_token
    assert cpt is not None
    ids = tokenizer._backend.encode(text, add_special_tokens=False).ids
    assert len(ids) >= math.ceil(len(text) / cpt)


def _tokenizer(model: Any, normalizer: Any = None, pre: Any = None) -> Tokenizer:
    tok = Tokenizer(model)
    if normalizer is not None:
        tok.normalizer = normalizer
    if pre is not None:
        tok.pre_tokenizer = pre
    return tok


def test_char_bound_only_where_the_pipeline_keeps_characters() -> None:
    vocab = {"<unk>": 0, "a": 1, "aaaa": 2}
    bpe = models.BPE(vocab, [], unk_token="<unk>")
    assert max_chars_per_token(_tokenizer(bpe)) == 5  # "<unk>"
    assert max_chars_per_token(_tokenizer(bpe, normalizers.NFC())) == 20
    assert max_chars_per_token(_tokenizer(bpe, normalizers.Replace("  ", " "))) == 10
    assert max_chars_per_token(_tokenizer(bpe, pre=pre_tokenizers.ByteLevel())) == 5
    unbounded = [
        _tokenizer(bpe, normalizers.Strip()),
        _tokenizer(bpe, normalizers.Replace(" ", "")),
        _tokenizer(bpe, pre=pre_tokenizers.Whitespace()),
        _tokenizer(models.BPE(vocab, [], unk_token="<unk>", fuse_unk=True)),
        _tokenizer(models.WordPiece({"[UNK]": 0, "a": 1}, unk_token="[UNK]")),
        _tokenizer(models.WordLevel({"[UNK]": 0, "a": 1}, unk_token="[UNK]")),
    ]
    assert [max_chars_per_token(t) for t in unbounded] == [None] * len(unbounded)


def test_nfc_merges_at_most_four_code_points() -> None:
    longest = max(
        len(unicodedata.normalize("NFD", chr(cp))) for cp in range(0x110000)
        if not 0xD800 <= cp <= 0xDFFF
        and unicodedata.normalize("NFC", unicodedata.normalize("NFD", chr(cp))) == chr(cp))
    assert longest <= 4
