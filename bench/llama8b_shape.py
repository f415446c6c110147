"""A model directory with Llama-3-8B's layer shape and random weights, built locally (no hub):
what a GPU benchmark of P/D should run, since the tiny test model's prefill and KV are too
small to show what moving KV costs or saves.

Each layer is Llama-3-8B's (hidden 4096, MLP 14336, 32 query heads, 8 KV heads of 128:
4 KiB of bf16 KV per token per layer, 128 KiB over its 32 layers); `--layers` takes fewer
than its 32 to fit several engines on one GPU (KV and prefill work scale with it: say the
count with every figure).
The vocabulary is the tiny model's (its tokenizer, 512 tokens), so prompts built for the
tiny model fit. bf16 weights, seeded: the same arguments give the same model.

    python bench/llama8b_shape.py OUT_DIR [--layers 8] [--device cuda]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM = 4096, 14336, 32, 8, 128
SHAPE = {"hidden_size": HIDDEN, "intermediate_size": INTER, "num_attention_heads": HEADS,
         "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM, "rope_theta": 500000.0,
         "max_position_embeddings": 8192, "rms_norm_eps": 1e-5}


def build(out: Path, layers: int, device: str, seed: int = 8) -> Path:
    import torch
    from safetensors.torch import save_file

    sys.path.insert(0, str(ROOT / "src"))
    from pdgate.engine_shim.tiny import TINY_CONFIG, build_tiny_tokenizer

    config = {**TINY_CONFIG, **SHAPE, "num_hidden_layers": layers, "torch_dtype": "bfloat16"}
    hidden, inter, vocab = HIDDEN, INTER, int(config["vocab_size"])
    q_out, kv_out = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    gen = torch.Generator(device=device).manual_seed(seed)

    def rand(*shape: int, std: float = 0.02, mean: float = 0.0) -> torch.Tensor:
        t = torch.randn(*shape, generator=gen, device=device, dtype=torch.float32) * std + mean
        return t.to(torch.bfloat16).cpu()

    tensors = {"model.embed_tokens.weight": rand(vocab, hidden, std=1.0),
               "model.norm.weight": rand(hidden, std=0.1, mean=1.0),
               "lm_head.weight": rand(vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        tensors |= {p + "input_layernorm.weight": rand(hidden, std=0.1, mean=1.0),
                    p + "post_attention_layernorm.weight": rand(hidden, std=0.1, mean=1.0),
                    p + "self_attn.q_proj.weight": rand(q_out, hidden),
                    p + "self_attn.k_proj.weight": rand(kv_out, hidden),
                    p + "self_attn.v_proj.weight": rand(kv_out, hidden),
                    p + "self_attn.o_proj.weight": rand(hidden, q_out),
                    p + "mlp.gate_proj.weight": rand(inter, hidden),
                    p + "mlp.up_proj.weight": rand(inter, hidden),
                    p + "mlp.down_proj.weight": rand(hidden, inter)}
    out.mkdir(parents=True, exist_ok=True)
    build_tiny_tokenizer(out)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", type=Path)
    p.add_argument("--layers", type=int, default=32, help="of Llama-3-8B's 32")
    p.add_argument("--device", default="cpu", help="where the random weights are drawn")
    args = p.parse_args()
    print(build(args.out, args.layers, args.device))


if __name__ == "__main__":
    main()
