"""A tiny random-weight Llama that vLLM's CPU backend can serve.

The shim's built-in tiny model (engine_shim/tiny.py) has head_dim 16, which vLLM-CPU's
attention kernels refuse ("Unsupported CPU attention configuration: head_dim=16"; they take
32, 64, 80, ...). This model keeps the same locally trained tokenizer (so the router and
the engines agree on every token id) and uses head_dim 32.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from pdgate.engine_shim.tiny import build_tiny_tokenizer

VLLM_TINY_CONFIG: dict[str, Any] = {
    "vocab_size": 512,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "max_position_embeddings": 16384,  # room for bench/e2e_vllm.py's 2,000-word prompts
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    # Larger than HF's 0.02 so greedy logits are well separated: a near tie could flip
    # between two correct float32 kernels and make "P/D equals colocated" flaky.
    "initializer_range": 0.5,
}
_SEED = 1234


def ensure_vllm_tiny_model(out_dir: Path) -> Path:
    """Build the model once into `out_dir` (atomically, by rename) and return it.

    Writes config.json, generation_config.json, model.safetensors, tokenizer.json and
    tokenizer_config.json (with the ChatML template)."""
    if (out_dir / "config.json").exists():
        return out_dir
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tmp = out_dir.parent / f".{out_dir.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    build_tiny_tokenizer(tmp)
    torch.manual_seed(_SEED)
    config = LlamaConfig(**VLLM_TINY_CONFIG)
    model = LlamaForCausalLM(config)  # float32 parameters (torch default)
    model.save_pretrained(str(tmp), safe_serialization=True)
    # Explicit: vLLM reads the dtype from config.json and --dtype overrides it anyway.
    cfg = json.loads((tmp / "config.json").read_text())
    cfg["torch_dtype"] = "float32"
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
    os.rename(tmp, out_dir)
    return out_dir
