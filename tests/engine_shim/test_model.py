"""The paged Llama matches HF transformers on the same weights, and bad inputs fail clearly.

Tolerance: float32 logits agree with `LlamaForCausalLM` within atol 1e-4 (observed ~1e-5);
the gap is float reassociation between HF's contiguous attention and ours over gathered blocks.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import msgspec
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaForCausalLM

from pdgate.engine_shim.kv_cache import PagedKVCache
from pdgate.engine_shim.kv_layout import BLOCK_MAJOR, LAYER_MAJOR, LAYOUT_NAME
from pdgate.engine_shim.model import LlamaModel
from pdgate.engine_shim.model_config import ModelConfig
from pdgate.engine_shim.sampler import Sampler, SamplingParams

ATOL = 1e-4
BLOCK_SIZE = 4
TABLE = [5, 2, 9]  # non-consecutive, out of order: exercises the gather
PROMPT = [1, 40, 77, 300, 5, 9, 100, 200, 31, 17, 18]  # 11 tokens -> 3 blocks of 4


@pytest.fixture(scope="module")
def model(tiny_model_dir: Path) -> LlamaModel:
    return LlamaModel.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir: Path) -> LlamaForCausalLM:
    hf = LlamaForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    assert not hf.training
    return hf


def hf_logits(hf: LlamaForCausalLM, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits: torch.Tensor = hf(torch.tensor([ids])).logits
    return logits[0].float()


def new_cache(model: LlamaModel, num_blocks: int = 12, layout: str = LAYOUT_NAME) -> PagedKVCache:
    return PagedKVCache(model.make_kv_layout(num_blocks, BLOCK_SIZE, layout), "cpu")


def test_prefill_logits_match_hf(model: LlamaModel, hf_model: LlamaForCausalLM) -> None:
    kv = new_cache(model)
    out = model.forward_paged(torch.tensor(PROMPT), 0, TABLE, kv)
    assert out.dtype == torch.float32
    assert out.shape == (len(PROMPT), model.config.vocab_size)
    torch.testing.assert_close(out, hf_logits(hf_model, PROMPT), atol=ATOL, rtol=0)


@pytest.mark.parametrize("layout", [LAYER_MAJOR, BLOCK_MAJOR])
def test_prefill_then_decode_matches_hf(model: LlamaModel, hf_model: LlamaForCausalLM,
                                        layout: str) -> None:
    """Both KV layouts: block-major hands the attention strided per-layer views."""
    kv = new_cache(model, layout=layout)
    rows = [model.forward_paged(torch.tensor(PROMPT[:3]), 0, TABLE, kv)]
    for pos in range(3, len(PROMPT)):
        rows.append(model.forward_paged(torch.tensor([PROMPT[pos]]), pos, TABLE, kv))
    torch.testing.assert_close(torch.cat(rows), hf_logits(hf_model, PROMPT), atol=ATOL, rtol=0)
    # Only the blocks in the table were written.
    touched = kv.planes().abs().sum(dim=(0, 1, 3, 4, 5)).nonzero().flatten().tolist()
    assert sorted(touched) == sorted(TABLE)


def test_last_only_returns_last_row(model: LlamaModel) -> None:
    full = model.forward_paged(torch.tensor(PROMPT), 0, TABLE, new_cache(model))
    last = model.forward_paged(torch.tensor(PROMPT), 0, TABLE, new_cache(model), last_only=True)
    torch.testing.assert_close(last, full[-1:], atol=ATOL, rtol=0)


def test_batch_decode_matches_single_sequence(model: LlamaModel) -> None:
    kv = new_cache(model)
    tables, prompts = [[5, 2, 9], [0, 7]], [PROMPT[:9], PROMPT[2:8]]
    for table, prompt in zip(tables, prompts, strict=True):
        model.forward_paged(torch.tensor(prompt[:-1]), 0, table, kv)
    batched = model.forward_paged_batch(
        torch.tensor([p[-1] for p in prompts]), [len(p) - 1 for p in prompts], tables, kv
    )
    for row, table, prompt in zip(batched, tables, prompts, strict=True):
        alone = model.forward_paged(torch.tensor(prompt), 0, table, new_cache(model))[-1]
        torch.testing.assert_close(row, alone, atol=ATOL, rtol=0)


def test_greedy_generation_matches_hf_generate(
    model: LlamaModel, hf_model: LlamaForCausalLM
) -> None:
    new_tokens = 16
    hf_model.generation_config.eos_token_id = None  # generate exactly 16, like our loop
    hf_model.generation_config.pad_token_id = 0
    with torch.no_grad():
        ref = hf_model.generate(
            torch.tensor([PROMPT]), max_new_tokens=new_tokens, do_sample=False
        )[0, len(PROMPT):].tolist()
    kv, table = new_cache(model, 16), [3, 8, 1, 12, 6, 0, 15]
    sampler = Sampler(SamplingParams(temperature=0.0))
    logits = model.forward_paged(torch.tensor(PROMPT), 0, table, kv, last_only=True)
    out = [sampler.sample(logits[-1])]
    while len(out) < new_tokens:
        pos = len(PROMPT) + len(out) - 1
        logits = model.forward_paged(torch.tensor([out[-1]]), pos, table, kv)
        out.append(sampler.sample(logits[-1]))
    assert out == ref


def test_short_block_table_and_bad_ids_are_rejected(model: LlamaModel) -> None:
    kv = new_cache(model)
    with pytest.raises(ValueError, match="need 3"):
        model.forward_paged(torch.tensor(PROMPT), 0, [5, 2], kv)
    with pytest.raises(ValueError, match="out of range"):
        model.forward_paged(torch.tensor(PROMPT), 0, [5, 2, 12], kv)


def test_cache_of_another_geometry_is_rejected(model: LlamaModel) -> None:
    layout = model.make_kv_layout(4, BLOCK_SIZE)
    kv = PagedKVCache(msgspec.structs.replace(layout, dtype="float16"), "cpu")
    with pytest.raises(ValueError, match="does not fit"):
        model.forward_paged(torch.tensor(PROMPT[:2]), 0, [0], kv)


def test_sharded_checkpoint_loads_identically(tiny_model_dir: Path, tmp_path: Path) -> None:
    tensors = load_file(str(tiny_model_dir / "model.safetensors"))
    names = sorted(tensors)
    shards = {"a.safetensors": names[::2], "b.safetensors": names[1::2]}
    for shard, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, str(tmp_path / shard))
    index = {"weight_map": {k: shard for shard, keys in shards.items() for k in keys}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    shutil.copy(tiny_model_dir / "config.json", tmp_path / "config.json")
    sharded = LlamaModel.from_pretrained(tmp_path)
    whole = LlamaModel.from_pretrained(tiny_model_dir)
    for (name, a), (_, b) in zip(
        sharded.state_dict().items(), whole.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), name


def test_missing_weights_are_a_clear_error(tiny_model_dir: Path, tmp_path: Path) -> None:
    shutil.copy(tiny_model_dir / "config.json", tmp_path / "config.json")
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        LlamaModel.from_pretrained(tmp_path)
    tensors = load_file(str(tiny_model_dir / "model.safetensors"))
    del tensors["model.norm.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="missing \\['norm.weight'\\]"):
        LlamaModel.from_pretrained(tmp_path)


def test_shape_mismatch_is_a_clear_error(tiny_model_dir: Path, tmp_path: Path) -> None:
    config = json.loads((tiny_model_dir / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "intermediate_size": 96}))
    shutil.copy(tiny_model_dir / "model.safetensors", tmp_path / "model.safetensors")
    pattern = r"mlp\.\w+_proj\.weight in model\.safetensors has shape .*, model expects"
    with pytest.raises(ValueError, match=pattern):
        LlamaModel.from_pretrained(tmp_path)


def _tiny_config(tiny_model_dir: Path) -> dict[str, object]:
    return dict(json.loads((tiny_model_dir / "config.json").read_text()))


def test_config_parses_tiny_and_defaults(tiny_model_dir: Path) -> None:
    cfg = ModelConfig.from_file(tiny_model_dir)
    assert (cfg.num_key_value_heads, cfg.head_dim, cfg.eos_token_ids) == (2, 16, (2,))
    raw = _tiny_config(tiny_model_dir)
    del raw["head_dim"], raw["num_key_value_heads"], raw["rope_theta"]
    raw.update(eos_token_id=[2, 4], rope_parameters={"rope_type": "default", "rope_theta": 5e5})
    cfg = ModelConfig.from_dict(raw)
    assert (cfg.head_dim, cfg.num_key_value_heads) == (16, 4)  # hidden/heads, heads
    assert (cfg.eos_token_ids, cfg.rope_theta) == ((2, 4), 5e5)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"architectures": ["Qwen2ForCausalLM"]}, "unsupported architectures"),
        ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_scaling .* not supported"),
        ({"rope_parameters": {"rope_type": "llama3"}}, "rope_type 'llama3' is not supported"),
        ({"hidden_size": None}, "hidden_size must be an integer"),
        ({"num_key_value_heads": 3}, "multiple of num_key_value_heads"),
        ({"torch_dtype": "float8"}, "dtype 'float8'"),
        ({"attention_bias": True}, "attention_bias"),
    ],
)
def test_config_errors_name_the_field(
    tiny_model_dir: Path, change: dict[str, object], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_dict({**_tiny_config(tiny_model_dir), **change})


def test_config_missing_field_and_file(tiny_model_dir: Path, tmp_path: Path) -> None:
    raw = _tiny_config(tiny_model_dir)
    del raw["vocab_size"]
    with pytest.raises(ValueError, match="missing required field\\(s\\) \\['vocab_size'\\]"):
        ModelConfig.from_dict(raw)
    with pytest.raises(ValueError, match="config.json not found"):
        LlamaModel.from_pretrained(tmp_path)
