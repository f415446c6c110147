"""A Llama-family decoder in plain torch whose attention reads and writes the paged KV cache.

Math follows HF `LlamaForCausalLM` (RMSNorm in float32, RoPE with the rotate-half convention,
GQA, SwiGLU) so logits match it on the same weights; the test suite checks that. Parameter
names equal HF's minus the leading `model.`, so `weights.load_weights` is a prefix strip.

Every forward is expressed as B sequences of Tq new tokens each: a prefill is B=1, Tq=T and a
batched decode step is B sequences, Tq=1. The new tokens' K/V are written into their cache
slots first; then each query attends over its sequence's gathered blocks with a causal mask
(key position j is visible to a query at position p iff j <= p), which also hides the unused
tail of the last block.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from pdgate.engine_shim.kv_cache import TORCH_DTYPES, PagedKVCache
from pdgate.engine_shim.kv_layout import LAYOUT_NAME, KVLayout
from pdgate.engine_shim.model_config import ModelConfig
from pdgate.engine_shim.weights import load_weights

_DTYPE_NAMES = {v: k for k, v in TORCH_DTYPES.items()}

# Attention kernels on CUDA: not cuDNN's. cuDNN builds an execution plan per new shape, and
# every new prompt length, and every decode step whose longest context crosses a block
# boundary, is a new shape: on an H200 (8 of Llama-3-8B's layers) a first use cost 55-550 ms
# against 8-14 ms after, while the memory-efficient kernel took 8-14 ms from the first call
# (docs/benchmarks.md, "The shim's decode step"). vLLM's attention does not build per shape
# either (CUDA graphs, varlen kernels).
_CUDA_SDPA = [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]


def _attention_kernels(device: torch.device) -> AbstractContextManager[None]:
    if device.type == "cuda":
        return sdpa_kernel(_CUDA_SDPA)
    return nullcontext()  # CPU: torch's choice, as the token-exact tests were recorded


class RMSNorm(nn.Module):
    """Root-mean-square norm, computed in float32 like HF Llama."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rope_cos_sin(
    positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin `[B, Tq, 1, head_dim]` for integer `positions` `[B, Tq]` (float32 math)."""
    exponents = torch.arange(0, head_dim, 2, device=positions.device).float() / head_dim
    inv_freq = 1.0 / (theta**exponents)
    freqs = positions.float()[..., None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)[:, :, None, :]
    return emb.cos().to(dtype), emb.sin().to(dtype)


@dataclass(frozen=True)
class _PagedBatch:
    """Where one forward's tokens go in the cache and what each query may see."""

    slots: torch.Tensor  # [B*Tq] flat slot (block * block_size + offset) of each new token
    tables: torch.Tensor  # [B, nb] block ids to gather per sequence
    mask: torch.Tensor  # [B, 1, Tq, nb*block_size] True where the key is visible


class LlamaAttention(nn.Module):
    """GQA self-attention over the paged cache (no biases, RoPE on q and k)."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        q_out, kv_out = self.num_heads * cfg.head_dim, self.num_kv_heads * cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, q_out, bias=False, dtype=dtype)
        self.k_proj = nn.Linear(cfg.hidden_size, kv_out, bias=False, dtype=dtype)
        self.v_proj = nn.Linear(cfg.hidden_size, kv_out, bias=False, dtype=dtype)
        self.o_proj = nn.Linear(q_out, cfg.hidden_size, bias=False, dtype=dtype)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        batch: _PagedBatch,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> torch.Tensor:
        b, tq, _ = x.shape
        cos, sin = rope
        q = self.q_proj(x).view(b, tq, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(b, tq, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(b, tq, self.num_kv_heads, self.head_dim)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        # Write before gathering so the new tokens see themselves.
        # (block, offset) indexing, not a flat view: in the block-major layout the cache is
        # strided over blocks and cannot be flattened without a copy.
        flat_shape = (-1, self.num_kv_heads, self.head_dim)
        where = (batch.slots // k_cache.shape[1], batch.slots % k_cache.shape[1])
        k_cache.index_put_(where, k.reshape(flat_shape))
        v_cache.index_put_(where, v.reshape(flat_shape))
        keys = self._gather(k_cache, batch.tables)
        values = self._gather(v_cache, batch.tables)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), keys, values, attn_mask=batch.mask
        )
        projected: torch.Tensor = self.o_proj(out.transpose(1, 2).reshape(b, tq, -1))
        return projected

    def _gather(self, cache: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
        """`[B, num_heads, nb*block_size, head_dim]`: the sequences' blocks, kv heads repeated
        so query head h reads kv head h // (num_heads / num_kv_heads), as HF's repeat_kv."""
        b, nb = tables.shape
        g = cache[tables].view(b, nb * cache.shape[1], self.num_kv_heads, self.head_dim)
        g = g.transpose(1, 2)
        return g.repeat_interleave(self.num_heads // self.num_kv_heads, dim=1)


class LlamaMLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        h, i = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = nn.Linear(h, i, bias=False, dtype=dtype)
        self.up_proj = nn.Linear(h, i, bias=False, dtype=dtype)
        self.down_proj = nn.Linear(i, h, bias=False, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return out


class LlamaDecoderLayer(nn.Module):
    """Pre-norm residual block: attention then MLP."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.self_attn = LlamaAttention(cfg, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.mlp = LlamaMLP(cfg, dtype)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        batch: _PagedBatch,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> torch.Tensor:
        attn: torch.Tensor = self.self_attn(
            self.input_layernorm(x), rope, batch, k_cache, v_cache
        )
        x = x + attn
        mlp: torch.Tensor = self.mlp(self.post_attention_layernorm(x))
        return x + mlp


class LlamaModel(nn.Module):
    """Llama causal LM over a `PagedKVCache`. Built by `from_pretrained`; the engine calls
    `make_kv_layout` once, then `forward_paged` (prefill / single-sequence decode) and
    `forward_paged_batch` (one decode token for each of several sequences).

    Not thread-safe: one forward at a time per (model, cache)."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        if dtype not in _DTYPE_NAMES:
            raise ValueError(f"unsupported model dtype {dtype}; use one of {list(TORCH_DTYPES)}")
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, dtype) for _ in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        # Tied checkpoints have no lm_head tensor; the output projection is the embedding.
        self.lm_head: nn.Linear | None = (
            None
            if config.tie_word_embeddings
            else nn.Linear(config.hidden_size, config.vocab_size, bias=False, dtype=dtype)
        )

    @classmethod
    def from_pretrained(
        cls, path: str | Path, device: str = "cpu", dtype: torch.dtype | str | None = None
    ) -> LlamaModel:
        """Load an HF Llama directory (config.json + safetensors) onto `device` in eval mode
        with gradients off. `dtype` defaults to the checkpoint's `torch_dtype`."""
        config = ModelConfig.from_file(path)
        torch_dtype = _resolve_dtype(dtype if dtype is not None else config.dtype)
        # Build on the meta device so no memory is spent on random init, then allocate once.
        with torch.device("meta"):
            model = cls(config, torch_dtype)
        model.to_empty(device=torch.device(device))
        load_weights(model, path)
        model.eval()
        model.requires_grad_(False)
        return model

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    def make_kv_layout(self, num_blocks: int, block_size: int,
                       layout: str = LAYOUT_NAME) -> KVLayout:
        """KV geometry for this model with `num_blocks` blocks of `block_size` tokens, in
        `layout` (a `kv_layout.LAYOUTS` value)."""
        return KVLayout(
            num_layers=self.config.num_hidden_layers,
            num_blocks=num_blocks,
            block_size=block_size,
            num_kv_heads=self.config.num_key_value_heads,
            head_dim=self.config.head_dim,
            dtype=_DTYPE_NAMES[self.dtype],
            layout=layout,
        )

    def forward_paged(
        self,
        input_ids: torch.Tensor,
        start_pos: int,
        block_table: Sequence[int],
        kv: PagedKVCache,
        *,
        last_only: bool = False,
    ) -> torch.Tensor:
        """Run T new tokens of one sequence at positions start_pos..start_pos+T-1.

        `input_ids`: 1-D long, T >= 1. `block_table[i]` is the cache block holding positions
        i*block_size..(i+1)*block_size-1; it must cover start_pos+T positions. Positions before
        start_pos must already be in the cache. Writes the new tokens' K/V, returns float32
        logits `[T, vocab]` (`[1, vocab]` for the last token when `last_only`).
        """
        if input_ids.dim() != 1 or input_ids.numel() == 0:
            raise ValueError(f"input_ids must be 1-D and non-empty, got {tuple(input_ids.shape)}")
        if start_pos < 0:
            raise ValueError(f"start_pos must be >= 0, got {start_pos}")
        t = input_ids.numel()
        positions = torch.arange(start_pos, start_pos + t, device=self.device)[None]
        tables = self._tables(kv, [block_table], [start_pos + t])
        logits = self._forward(input_ids.to(self.device)[None], positions, tables, kv, last_only)
        return logits[0]

    def forward_paged_batch(
        self,
        input_ids: torch.Tensor,
        positions: Sequence[int],
        block_tables: Sequence[Sequence[int]],
        kv: PagedKVCache,
    ) -> torch.Tensor:
        """One decode step for B sequences: token `input_ids[b]` (1-D long `[B]`) sits at
        `positions[b]` of sequence b, whose blocks are `block_tables[b]`. Same contract as
        `forward_paged` per sequence. Returns float32 logits `[B, vocab]`."""
        b = input_ids.numel()
        if input_ids.dim() != 1 or b == 0 or len(positions) != b or len(block_tables) != b:
            raise ValueError(
                f"need B >= 1 tokens with B positions and B block tables, got "
                f"{tuple(input_ids.shape)}, {len(positions)}, {len(block_tables)}"
            )
        if min(positions) < 0:
            raise ValueError(f"positions must be >= 0, got {list(positions)}")
        pos = torch.tensor(list(positions), dtype=torch.long, device=self.device)[:, None]
        tables = self._tables(kv, block_tables, [p + 1 for p in positions])
        logits = self._forward(input_ids.to(self.device)[:, None], pos, tables, kv, True)
        return logits[:, 0]

    @torch.inference_mode()
    def _forward(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        tables: torch.Tensor,
        kv: PagedKVCache,
        last_only: bool,
    ) -> torch.Tensor:
        """ids/positions `[B, Tq]`, tables `[B, nb]` -> float32 logits `[B, Tq or 1, V]`."""
        bs = kv.layout.block_size
        slots = tables.gather(1, positions // bs) * bs + positions % bs
        keys_pos = torch.arange(tables.shape[1] * bs, device=self.device)
        mask = (keys_pos[None, None, :] <= positions[:, :, None])[:, None]
        batch = _PagedBatch(slots=slots.reshape(-1), tables=tables, mask=mask)
        rope = _rope_cos_sin(positions, self.config.head_dim, self.config.rope_theta, self.dtype)
        h = self.embed_tokens(ids)
        with _attention_kernels(h.device):
            for i, layer in enumerate(self.layers):
                h = layer(h, rope, batch, kv.key(i), kv.value(i))
        h = self.norm(h[:, -1:] if last_only else h)
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(h, weight).float()

    def _tables(
        self, kv: PagedKVCache, tables: Sequence[Sequence[int]], lengths: Sequence[int]
    ) -> torch.Tensor:
        """Validate and pad the block tables to `[B, nb]` (nb = most blocks any sequence
        needs). Padding repeats a sequence's first block; the causal mask hides it."""
        self._check_cache(kv)
        layout = kv.layout
        rows: list[list[int]] = []
        for table, length in zip(tables, lengths, strict=True):
            need = layout.blocks_for_tokens(length)
            if len(table) < need:
                raise ValueError(
                    f"block table has {len(table)} blocks, {length} positions need {need}"
                )
            row = list(table[:need])
            if min(row) < 0 or max(row) >= layout.num_blocks:
                raise ValueError(f"block ids out of range [0, {layout.num_blocks}): {row}")
            rows.append(row)
        nb = max(len(r) for r in rows)
        padded = [r + [r[0]] * (nb - len(r)) for r in rows]
        return torch.tensor(padded, dtype=torch.long, device=self.device)

    def _check_cache(self, kv: PagedKVCache) -> None:
        layout, cfg = kv.layout, self.config
        if (layout.num_layers, layout.num_kv_heads, layout.head_dim) != (
            cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim,
        ) or layout.dtype != _DTYPE_NAMES[self.dtype]:
            raise ValueError(f"KV layout {layout} does not fit this model ({cfg}, {self.dtype})")
        if kv.device != self.device:
            raise ValueError(f"KV cache on {kv.device}, model on {self.device}")


def _resolve_dtype(dtype: torch.dtype | str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    name = dtype.removeprefix("torch.")
    if name not in TORCH_DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; use one of {list(TORCH_DTYPES)}")
    return TORCH_DTYPES[name]
