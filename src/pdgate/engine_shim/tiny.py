"""The built-in tiny model: a locally trained BPE tokenizer and a random-weight Llama.

`--model tiny` and the test fixtures use this so nothing needs a model hub. The output is an
ordinary HF-format directory (config.json, model.safetensors, tokenizer.json,
tokenizer_config.json), so the same loader serves it and real checkpoints, and
`transformers` can load it for the reference-logits test. Everything is deterministic: the
same version string always yields byte-identical weights and the same vocabulary.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

TINY_VERSION = "1"
TINY_MODEL_NAME = "pdgate-tiny"
TINY_SEED = 1234  # the default weights; `pdgate up --models N` uses TINY_SEED + i
_SEED = TINY_SEED
_VOCAB_SIZE = 512

TINY_CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "hidden_act": "silu",
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "vocab_size": _VOCAB_SIZE,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "torch_dtype": "float32",
}

# ChatML-style template; `add_generation_prompt` appends the assistant header.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]

_CORPUS = """
The quick brown fox jumps over the lazy dog. A disaggregated serving system splits prompt
prefill from token decode. Prefill engines compute the key value cache for the whole prompt;
decode engines read those blocks over the network and generate one token at a time.
Hello world! How are you today? I am a tiny language model with random weights.
Paged attention stores keys and values in fixed size blocks. Routers pick engines by load,
by prefix, and by health. Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000 2048 4096.
Once upon a time, in a data center far away, GPUs moved tensors between machines.
What is the capital of France? Paris is the capital of France. Tell me a story about a cat.
""".strip()


def default_cache_dir() -> Path:
    """Where `--model tiny` materialises the model unless told otherwise."""
    root = os.environ.get("PDGATE_CACHE_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "pdgate"
    )
    return Path(root) / f"tiny-v{TINY_VERSION}"


def build_tiny_tokenizer(out_dir: Path) -> None:
    """Train the byte-level BPE and write tokenizer.json + tokenizer_config.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=_VOCAB_SIZE,
        special_tokens=_SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([_CORPUS] * 4, trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A $B", special_tokens=[("<s>", 1)]
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "model_max_length": TINY_CONFIG["max_position_embeddings"],
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2))


def build_tiny_weights(out_dir: Path, seed: int = _SEED) -> None:
    """Write config.json and seeded random weights as model.safetensors (HF Llama names);
    another `seed` gives another model of the same shape and tokenizer."""
    import torch
    from safetensors.torch import save_file

    c = TINY_CONFIG
    hidden, inter, vocab = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    q_out = c["num_attention_heads"] * c["head_dim"]
    kv_out = c["num_key_value_heads"] * c["head_dim"]
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int, std: float = 0.2) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float32) * std

    tensors: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": rand(vocab, hidden, std=1.0),
        "model.norm.weight": 1.0 + rand(hidden, std=0.1),
        "lm_head.weight": rand(vocab, hidden),
    }
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        tensors[p + "input_layernorm.weight"] = 1.0 + rand(hidden, std=0.1)
        tensors[p + "post_attention_layernorm.weight"] = 1.0 + rand(hidden, std=0.1)
        tensors[p + "self_attn.q_proj.weight"] = rand(q_out, hidden)
        tensors[p + "self_attn.k_proj.weight"] = rand(kv_out, hidden)
        tensors[p + "self_attn.v_proj.weight"] = rand(kv_out, hidden)
        tensors[p + "self_attn.o_proj.weight"] = rand(hidden, q_out)
        tensors[p + "mlp.gate_proj.weight"] = rand(inter, hidden)
        tensors[p + "mlp.up_proj.weight"] = rand(inter, hidden)
        tensors[p + "mlp.down_proj.weight"] = rand(hidden, inter)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(c, indent=2))


def ensure_tiny_model(out_dir: Path | None = None, *, weights: bool = True,
                      seed: int = _SEED) -> Path:
    """Materialise the tiny model once (atomically) and return its directory. `seed`
    picks its weights (`pdgate up --models N`: one seed per model); a seed other than the
    default has a cache directory of its own.

    Several processes (two engines, a router) may call this at the same moment, so the
    model is built in a private temporary directory and renamed into place.
    """
    target = out_dir or default_cache_dir()
    if out_dir is None and seed != _SEED:
        target = target.parent / f"{target.name}-seed{seed}"
    marker = target / ("config.json" if weights else "tokenizer.json")
    if marker.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / f".{target.name}.tmp-{os.getpid()}"
    build_tiny_tokenizer(tmp)
    if weights:
        build_tiny_weights(tmp, seed)
    try:
        os.rename(tmp, target)
    except OSError:
        # Somebody else won the race (or a tokenizer-only build exists): keep theirs.
        import shutil

        if not marker.exists():
            shutil.rmtree(target, ignore_errors=True)
            os.rename(tmp, target)
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    return target
