"""Load HF `*.safetensors` checkpoints (one file or many shards) into a torch module.

Checkpoint names follow HF Llama (`model.layers.0.self_attn.q_proj.weight`, `lm_head.weight`);
the shim's `LlamaModel` uses the same names without the leading `model.`, so the mapping is a
prefix strip. Every parameter must be filled exactly once with the right shape: a partial
load would serve garbage silently, so missing, unexpected and mis-shaped tensors are errors.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

INDEX_FILE = "model.safetensors.index.json"
# Buffers some older exports saved that the shim recomputes; skipping them is safe.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def checkpoint_files(model_dir: str | Path) -> list[Path]:
    """The safetensors files of `model_dir`: those the shard index names, else every
    `*.safetensors` file. Raises FileNotFoundError when there are none or a shard is absent."""
    root = Path(model_dir)
    index = root / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        files = sorted({root / name for name in weight_map.values()})
        absent = [str(f) for f in files if not f.is_file()]
        if absent:
            raise FileNotFoundError(f"checkpoint shards named in {index} are missing: {absent}")
        if not files:
            raise FileNotFoundError(f"{index} names no shards")
        return files
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {root}")
    return files


def load_weights(module: torch.nn.Module, model_dir: str | Path) -> None:
    """Copy every checkpoint tensor into `module`'s parameters (cast to each parameter's dtype
    and device). Raises ValueError on missing, unexpected or mis-shaped tensors."""
    params = dict(module.named_parameters())
    loaded: set[str] = set()
    unexpected: list[str] = []
    with torch.no_grad():
        for path in checkpoint_files(model_dir):
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for key in f.keys():
                    name = key.removeprefix("model.")
                    if name.endswith(_IGNORED_SUFFIXES):
                        continue
                    param = params.get(name)
                    if param is None:
                        unexpected.append(key)
                        continue
                    tensor = f.get_tensor(key)
                    if tuple(tensor.shape) != tuple(param.shape):
                        raise ValueError(
                            f"checkpoint tensor {key} in {path.name} has shape "
                            f"{tuple(tensor.shape)}, model expects {tuple(param.shape)}"
                        )
                    param.copy_(tensor)
                    loaded.add(name)
    missing = sorted(set(params) - loaded)
    if missing or unexpected:
        raise ValueError(
            f"checkpoint in {model_dir} does not match the model: "
            f"missing {missing[:8]}{'...' if len(missing) > 8 else ''}, "
            f"unexpected {unexpected[:8]}{'...' if len(unexpected) > 8 else ''}"
        )
