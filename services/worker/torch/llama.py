"""A Llama-family decoder in plain torch, for the torch engine: batched decode, no transformers.

Why not transformers' model classes: a decode step there runs one sequence at a time (its
caches of different lengths do not batch without padding), and importing transformers costs
a cold worker seconds. This module reads the same Hugging Face folder (config.json and
safetensors weights) and computes the same function: RMSNorm, rotary position embeddings
(default rope only), grouped-query attention with optional q/k/v bias, a SwiGLU MLP. Its
logits match transformers' to float rounding (checked by tests/component/test_llama_native).

`supports(config)` says whether a folder's model is one this module computes exactly; the
engine falls back to transformers for any other.

Each sequence keeps its KV in `SequenceKV`: per-layer buffers with spare room, so a decode
step writes one position in place instead of copying the whole cache. `decode` runs one new
token for each of B sequences: the projections and MLP as [B, hidden] matrix products (where
batching pays). Attention is batched too when every sequence of the step lives in the model's
`KVPool` (one slot each): the new positions are written and the caches gathered with a few
indexed operations for the whole batch. Otherwise (the pool was full, or a sequence outgrew
its slot) attention runs per sequence over its own cache, several small operations each,
which on a CPU cost about as much as the rest of the step together.
"""

from __future__ import annotations

import json
import threading
import weakref
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.nn.functional as F

SUPPORTED_ARCHITECTURES = frozenset({"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"})
_GROW_MIN = 64  # tokens of spare room a buffer gains when it grows
_MIN_POOLED_TOKENS = 256  # a pool whose slots hold fewer tokens is not made
# Batched attention copies the batch's caches (padded to the longest) every step; per-sequence
# attention reads them in place. Past this length the copy costs more than the small ops it
# saves (measured on CPU: at 16 sequences the batched step is faster up to 512 tokens).
_POOLED_SPAN_MAX = 1024


def supports(config: dict[str, Any]) -> bool:
    """Whether this module computes `config`'s model exactly as transformers would."""
    archs = config.get("architectures") or []
    if len(archs) != 1 or archs[0] not in SUPPORTED_ARCHITECTURES:
        return False
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if (rope.get("rope_type") or rope.get("type") or "default") != "default":
        return False
    if config.get("hidden_act", "silu") != "silu" or config.get("mlp_bias"):
        return False
    # Mistral applies its sliding window whenever one is set; Qwen2 only when asked to.
    if config.get("sliding_window") and config.get("use_sliding_window", archs[0] == "MistralForCausalLM"):
        return False
    layer_types = config.get("layer_types")
    return not layer_types or all(t == "full_attention" for t in layer_types)


class _Layer:
    """A view of one layer's KV buffers as transformers' cache layers show it:
    keys and values of [1, kv_heads, tokens, head_dim]."""

    __slots__ = ("keys", "values")

    def __init__(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        self.keys, self.values = keys, values


class KVPool:
    """KV memory for `slots` sequences of up to `capacity` tokens: per layer, keys and values
    of [slots, kv_heads, capacity, head_dim]. A pooled SequenceKV's buffers are views of its
    slot; the slot returns to the pool when that SequenceKV is garbage collected, so nothing
    that still holds the SequenceKV (a running sequence, the session memory, a pending KV
    save) can see its memory reused."""

    def __init__(
        self,
        layers: int,
        slots: int,
        kv_heads: int,
        capacity: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        shape = (slots, kv_heads, capacity, head_dim)
        # Zeros, not empty: positions past a sequence's length are masked out of attention,
        # and a masked weight of 0 times a NaN left in uninitialised memory would still be NaN.
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.slots = slots
        self.capacity = capacity
        self._free = list(range(slots - 1, -1, -1))
        self._lock = threading.Lock()  # slots come back from finalizers, on whichever thread

    @property
    def free(self) -> int:
        return len(self._free)

    def take(self) -> "SequenceKV | None":
        """An empty sequence in a free slot, or None when every slot is taken."""
        with self._lock:
            if not self._free:
                return None
            slot = self._free.pop()
        cache = SequenceKV([k[slot] for k in self.keys], [v[slot] for v in self.values], 0)
        cache.pool, cache.slot = self, slot
        weakref.finalize(cache, self._give_back, slot)
        return cache

    def _give_back(self, slot: int) -> None:
        with self._lock:
            self._free.append(slot)


class SequenceKV:
    """One sequence's KV cache: per layer, key and value buffers of
    [kv_heads, capacity, head_dim], of which the first `length` positions are filled.
    `pool` is the KVPool whose slot the buffers are, while they are (None otherwise)."""

    __slots__ = ("keys", "values", "length", "pool", "slot", "__weakref__")

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor], length: int) -> None:
        self.keys, self.values, self.length = keys, values, length
        self.pool: KVPool | None = None
        self.slot = -1

    @classmethod
    def from_pairs(cls, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], pool: KVPool | None = None) -> "SequenceKV":
        """From per-layer (keys, values) of [1, kv_heads, tokens, head_dim] (copied), into a
        slot of `pool` when one is free and large enough."""
        tokens = pairs[0][0].shape[2] if pairs else 0
        cache = pool.take() if pool is not None and tokens < pool.capacity else None
        if cache is None:
            keys = [k[0].contiguous().clone() for k, _v in pairs]
            values = [v[0].contiguous().clone() for _k, v in pairs]
            return cls(keys, values, tokens)
        for layer, (k, v) in enumerate(pairs):
            cache.keys[layer][:, :tokens] = k[0]
            cache.values[layer][:, :tokens] = v[0]
        cache.length = tokens
        return cache

    def get_seq_length(self) -> int:
        return self.length

    @property
    def layers(self) -> list[_Layer]:
        """Views of the filled part, as in transformers' DynamicCache (for the KV store). A
        pooled cache's views stay valid only while this SequenceKV is alive: hold it too."""
        n = self.length
        return [_Layer(k[None, :, :n], v[None, :, :n]) for k, v in zip(self.keys, self.values)]

    def truncated(self, tokens: int) -> "SequenceKV":
        """A copy holding the first `tokens` positions (in a slot of this cache's pool when
        one is free). A copy, not a cut in place: a pending save may still read this cache's
        filled positions."""
        if not 0 <= tokens <= self.length:
            raise ValueError(f"cannot keep {tokens} of {self.length} cached tokens")
        return SequenceKV.from_pairs(
            [(layer.keys[:, :, :tokens], layer.values[:, :, :tokens]) for layer in self.layers], self.pool
        )

    def reserve(self, tokens: int) -> None:
        """Room for `tokens` more positions. Growing allocates new buffers and leaves the old
        ones to whoever still views them; a pooled cache that outgrows its slot leaves the
        pool (the slot itself comes back only when this SequenceKV is collected)."""
        need = self.length + tokens
        if not self.keys or need <= self.keys[0].shape[1]:
            return
        capacity = max(need + _GROW_MIN, 2 * self.keys[0].shape[1])
        for store in (self.keys, self.values):
            for i, old in enumerate(store):
                new = old.new_empty((old.shape[0], capacity, old.shape[2]))
                new[:, : self.length] = old[:, : self.length]
                store[i] = new
        self.pool = None


class LlamaModel:
    """The weights of a Llama-family model and its forward passes (no autograd)."""

    def __init__(self, model_dir: Path, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> None:
        from safetensors.torch import load_file

        model_dir = Path(model_dir)
        config = json.loads((model_dir / "config.json").read_text())
        config = config.get("text_config") or config
        if not supports(config):
            raise ValueError(f"{model_dir}: not a model this module computes exactly")
        self.config = config
        self.device = torch.device(device)
        self.dtype = dtype
        self.layers_count = int(config["num_hidden_layers"])
        self.heads = int(config["num_attention_heads"])
        self.kv_heads = int(config.get("num_key_value_heads") or self.heads)
        self.head_dim = int(config.get("head_dim") or config["hidden_size"] // self.heads)
        self.eps = float(config["rms_norm_eps"])
        rope = config.get("rope_parameters") or {}
        theta = float(rope.get("rope_theta", config.get("rope_theta", 10000.0)))
        exponents = torch.arange(0, self.head_dim, 2, dtype=torch.int64).float() / self.head_dim
        self._inv_freq = (1.0 / theta**exponents).to(self.device)

        weights: dict[str, torch.Tensor] = {}
        for file in sorted(model_dir.glob("*.safetensors")):
            weights.update(load_file(str(file)))
        prefix = "model." if "model.embed_tokens.weight" in weights else ""

        def take(name: str, optional: bool = False) -> torch.Tensor | None:
            tensor = weights.get(prefix + name)
            if tensor is None:
                if optional:
                    return None
                raise ValueError(f"{model_dir}: weight {prefix + name} is missing")
            return tensor.to(device=self.device, dtype=dtype)

        self.embed = take("embed_tokens.weight")
        self.norm = take("norm.weight")
        head = weights.get("lm_head.weight")
        self.lm_head = (
            self.embed
            if head is None or config.get("tie_word_embeddings")
            else head.to(device=self.device, dtype=dtype)
        )
        self.layers = []
        for i in range(self.layers_count):
            p = f"layers.{i}."
            self.layers.append(
                {
                    "input_norm": take(p + "input_layernorm.weight"),
                    "post_norm": take(p + "post_attention_layernorm.weight"),
                    "q": take(p + "self_attn.q_proj.weight"),
                    "q_bias": take(p + "self_attn.q_proj.bias", True),
                    "k": take(p + "self_attn.k_proj.weight"),
                    "k_bias": take(p + "self_attn.k_proj.bias", True),
                    "v": take(p + "self_attn.v_proj.weight"),
                    "v_bias": take(p + "self_attn.v_proj.bias", True),
                    "o": take(p + "self_attn.o_proj.weight"),
                    "o_bias": take(p + "self_attn.o_proj.bias", True),
                    "gate": take(p + "mlp.gate_proj.weight"),
                    "up": take(p + "mlp.up_proj.weight"),
                    "down": take(p + "mlp.down_proj.weight"),
                }
            )
        self.vocab_size = int(self.lm_head.shape[0])
        self.pool: KVPool | None = None

    def attach_pool(self, slots: int, max_bytes: int) -> KVPool | None:
        """Gives the model a KVPool of `slots` slots, each as long as fits in `max_bytes`
        (at most the model's context); None, and no pool, when a slot would be too short to
        be worth it."""
        per_token = 2 * self.layers_count * self.kv_heads * self.head_dim * self.embed.element_size()
        context = int(self.config.get("max_position_embeddings") or 4096)
        capacity = min(context, max_bytes // max(1, slots * per_token))
        if slots < 1 or capacity < _MIN_POOLED_TOKENS:
            self.pool = None
        else:
            self.pool = KVPool(
                self.layers_count, slots, self.kv_heads, capacity, self.head_dim, self.dtype, self.device
            )
        return self.pool

    def new_cache(self, capacity: int = _GROW_MIN) -> SequenceKV:
        """An empty cache with room for `capacity` tokens: a pool slot when one is free and
        long enough, else buffers of its own."""
        if self.pool is not None and capacity <= self.pool.capacity:
            pooled = self.pool.take()
            if pooled is not None:
                return pooled
        shape = (self.kv_heads, capacity, self.head_dim)
        keys = [torch.empty(shape, dtype=self.dtype, device=self.device) for _ in range(self.layers_count)]
        values = [torch.empty(shape, dtype=self.dtype, device=self.device) for _ in range(self.layers_count)]
        return SequenceKV(keys, values, 0)

    # --- pieces -------------------------------------------------------------------------
    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        # As transformers' LlamaRMSNorm: the statistics in float32, the scale in the model dtype.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return weight * x32.to(x.dtype)

    def _rotary(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[:, None].float() * self._inv_freq[None, :]
        angles = torch.cat((freqs, freqs), dim=-1)
        return angles.cos().to(self.dtype), angles.sin().to(self.dtype)

    @staticmethod
    def _rotate_half(x: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        return torch.cat((-x[..., half:], x[..., :half]), dim=-1)

    def _qkv(self, layer: dict, h: torch.Tensor, rows: int) -> tuple[torch.Tensor, ...]:
        q = F.linear(h, layer["q"], layer["q_bias"]).view(rows, self.heads, self.head_dim)
        k = F.linear(h, layer["k"], layer["k_bias"]).view(rows, self.kv_heads, self.head_dim)
        v = F.linear(h, layer["v"], layer["v_bias"]).view(rows, self.kv_heads, self.head_dim)
        return q, k, v

    def _rotated_qkv(
        self, layer: dict, x: torch.Tensor, rows: int, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        """The layer's queries, keys (both with rotary positions) and values of `x`."""
        q, k, v = self._qkv(layer, self._rms_norm(x, layer["input_norm"]), rows)
        return q * cos + self._rotate_half(q) * sin, k * cos + self._rotate_half(k) * sin, v

    def _mlp_block(self, layer: dict, x: torch.Tensor) -> torch.Tensor:
        h = self._rms_norm(x, layer["post_norm"])
        return x + F.linear(F.silu(F.linear(h, layer["gate"])) * F.linear(h, layer["up"]), layer["down"])

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(self._rms_norm(x, self.norm), self.lm_head)

    # --- forward passes -------------------------------------------------------------------
    def prefill(self, cache: SequenceKV, ids: Sequence[int]) -> torch.Tensor:
        """Runs `ids` on top of `cache` (extending it); the logits after the last one."""
        return self.prefill_many([cache], [ids])[0]

    @torch.inference_mode()
    def prefill_many(self, caches: Sequence[SequenceKV], id_lists: Sequence[Sequence[int]]) -> torch.Tensor:
        """Runs each id list on top of its cache (extending it), all in one forward pass: the
        sequences' tokens are stacked for the projections and MLP, attention runs per
        sequence. Logits after each sequence's last token: [B, vocab]."""
        lengths = [len(ids) for ids in id_lists]
        if not lengths or min(lengths) < 1:
            raise ValueError("prefill needs at least one token per sequence")
        pasts = [cache.length for cache in caches]
        for cache, t in zip(caches, lengths):
            cache.reserve(t)
        rows = sum(lengths)
        flat = [token for ids in id_lists for token in ids]
        x = self.embed[torch.tensor(flat, dtype=torch.long, device=self.device)]
        positions = torch.cat([torch.arange(p, p + t, device=self.device) for p, t in zip(pasts, lengths)])
        cos, sin = self._rotary(positions)
        cos, sin = cos[:, None], sin[:, None]  # [rows, 1, dim], broadcast over heads
        spans, start = [], 0
        for cache, past, t in zip(caches, pasts, lengths):
            mask = None
            if past:  # query i sees the past and the new tokens up to itself
                mask = torch.ones(t, past + t, dtype=torch.bool, device=self.device).tril(past)[None]
            spans.append((cache, past, t, start, mask))
            start += t
        gqa = self.kv_heads != self.heads
        for i, layer in enumerate(self.layers):
            q, k, v = self._rotated_qkv(layer, x, rows, cos, sin)  # [rows, heads, dim]
            attended = []
            for cache, past, t, first, mask in spans:
                cache.keys[i][:, past : past + t] = k[first : first + t].transpose(0, 1)
                cache.values[i][:, past : past + t] = v[first : first + t].transpose(0, 1)
                keys, values = cache.keys[i][:, : past + t], cache.values[i][:, : past + t]
                out = F.scaled_dot_product_attention(
                    q[first : first + t].transpose(0, 1)[None],
                    keys[None],
                    values[None],
                    attn_mask=mask,
                    is_causal=not past,
                    enable_gqa=gqa,
                )[0]
                attended.append(out.transpose(0, 1).reshape(t, -1))
            x = x + F.linear(torch.cat(attended), layer["o"], layer["o_bias"])
            x = self._mlp_block(layer, x)
        last = [first + t - 1 for _cache, _past, t, first, _mask in spans]
        for cache, past, t in zip(caches, pasts, lengths):
            cache.length = past + t
        return self._logits(x[last])

    @torch.inference_mode()
    def decode(self, caches: Sequence[SequenceKV], tokens: Sequence[int]) -> torch.Tensor:
        """One new token for each sequence (extending each cache); logits of [B, vocab].
        Attention runs for the whole batch when every sequence lives in the pool (and none is
        long), else per sequence; the rest of the step is the same either way."""
        b = len(tokens)
        for cache in caches:
            cache.reserve(1)
        positions = [cache.length for cache in caches]
        at = torch.tensor(positions, device=self.device)
        pool = self.pool
        if pool is not None and all(cache.pool is pool for cache in caches) and max(positions) < _POOLED_SPAN_MAX:
            attend = self._pooled_attention(pool, caches, positions, at)
        else:
            attend = self._per_sequence_attention(caches, positions)
        x = self.embed[torch.tensor(list(tokens), dtype=torch.long, device=self.device)]
        cos, sin = self._rotary(at)
        cos, sin = cos[:, None], sin[:, None]  # [b, 1, dim], broadcast over heads
        for i, layer in enumerate(self.layers):
            q, k, v = self._rotated_qkv(layer, x, b, cos, sin)
            x = x + F.linear(attend(i, q, k, v).reshape(b, -1), layer["o"], layer["o_bias"])
            x = self._mlp_block(layer, x)
        for cache, pos in zip(caches, positions):
            cache.length = pos + 1
        return self._logits(x)

    def _per_sequence_attention(self, caches: Sequence[SequenceKV], positions: list[int]):
        """Layer i's attention with each sequence's new key and value written into its own
        cache and attended over it in place: several small operations per sequence."""
        gqa = self.kv_heads != self.heads

        def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            attended = []
            for row, (cache, pos) in enumerate(zip(caches, positions)):
                cache.keys[i][:, pos] = k[row]
                cache.values[i][:, pos] = v[row]
                keys, values = cache.keys[i][:, : pos + 1], cache.values[i][:, : pos + 1]
                attended.append(
                    F.scaled_dot_product_attention(q[row][None, :, None], keys[None], values[None], enable_gqa=gqa)[
                        0, :, 0
                    ]
                )
            return torch.stack(attended)

        return attend

    def _pooled_attention(self, pool: KVPool, caches: Sequence[SequenceKV], positions: list[int], at: torch.Tensor):
        """Layer i's attention for sequences that all live in `pool`: one indexed write of the
        batch's new keys and values, one gather of the batch's caches (padded to the longest,
        the padding masked out) and one attention call, whatever the batch size."""
        gqa = self.kv_heads != self.heads
        slots = torch.tensor([cache.slot for cache in caches], device=self.device)
        span = max(positions) + 1
        # [b, 1, 1, span]: row r sees positions 0..positions[r] (its past and the new token).
        visible = (torch.arange(span, device=self.device)[None, :] <= at[:, None])[:, None, None, :]

        def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            pool_keys, pool_values = pool.keys[i], pool.values[i]
            pool_keys[slots, :, at] = k  # [b, kv_heads, dim] into (slot, position) pairs
            pool_values[slots, :, at] = v
            keys = pool_keys[:, :, :span].index_select(0, slots)  # [b, kv_heads, span, dim]
            values = pool_values[:, :, :span].index_select(0, slots)
            return F.scaled_dot_product_attention(
                q[:, :, None], keys, values, attn_mask=visible, enable_gqa=gqa
            )  # [b, heads, 1, dim]

        return attend
