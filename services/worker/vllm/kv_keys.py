"""Session KV on the vLLM path: block names shared with the torch engine.

The cache service stores a session's KV in blocks of `worker.kv_block_tokens` tokens, named
by chained hashes over (model version, tenant, block size, tokens) (`services.cache.blocks`)
and laid out as [layers, 2 (keys, values), kv_heads, block_tokens, head_dim] in the model's
dtype (`services.worker.kv.tensors`). A vLLM worker that names and lays out its blocks the
same way shares them with torch workers of the same model version: a session can fail over
between the two engines and still restore its prefix.

vLLM keeps KV in pages of `block_size` tokens scattered over one paged tensor per layer.
`ConnectorKeys` maps a request to stored blocks: a stored block is `block_tokens /
block_size` whole pages, so the stored block size must be a multiple of vLLM's page size;
names come from the same `chain_hashes`, the tenant being the one the worker authenticated.
The bytes of a block move between pages and the store in `kv_pages`.

Not covered, and refused by `stored_layout` (None): fp8 KV (the store holds 16/32-bit
blocks only, and fp8 needs its scales), multi-head latent attention, and sliding-window or
hybrid models.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from services.cache.blocks import chain_hashes
from services.cache.types import DTYPE_SIZES, KVLayout, KVScope
from services.worker.kv.session import restorable_blocks
from services.worker.vllm.checks import ModelFacts


def stored_layout(facts: ModelFacts, kv_dtype: str, block_tokens: int) -> KVLayout | None:
    """The layout a torch worker stores this model's blocks in, when vLLM's KV can be
    stored that way at all (see the module docstring for what cannot)."""
    if kv_dtype not in DTYPE_SIZES or facts.mla_latent_dim or not facts.full_attention_only:
        return None
    shape = (facts.layers, 2, facts.kv_heads, block_tokens, facts.head_dim)
    return KVLayout(kv_dtype, shape, facts.layers, block_tokens)


@dataclass(frozen=True)
class ConnectorKeys:
    """Names and page mapping of one model's stored blocks, as a vLLM connector needs them."""

    model_version: str
    block_tokens: int  # tokens per stored block (worker.kv_block_tokens)
    page_tokens: int  # vLLM's block_size

    def __post_init__(self) -> None:
        if self.block_tokens <= 0 or self.page_tokens <= 0 or self.block_tokens % self.page_tokens:
            raise ValueError(
                f"worker.kv_block_tokens {self.block_tokens} must be a positive multiple of vLLM's "
                f"block_size {self.page_tokens}, so each stored block is whole vLLM pages"
            )

    @property
    def pages_per_block(self) -> int:
        return self.block_tokens // self.page_tokens

    def scope(self, tenant: str) -> KVScope:
        return KVScope(self.model_version, tenant)

    def block_names(self, tenant: str, token_ids: Sequence[int], max_blocks: int | None = None) -> list[bytes]:
        """The names a torch worker would store these tokens' full blocks under."""
        return chain_hashes(self.scope(tenant), self.block_tokens, token_ids, max_blocks)

    def lookup_names(self, tenant: str, token_ids: Sequence[int]) -> list[bytes]:
        """Names worth looking up for a context: never a block holding its last token,
        whose logits the first new token needs (as on the torch engine)."""
        return self.block_names(tenant, token_ids, restorable_blocks(len(token_ids), self.block_tokens))

    def loadable_tokens(self, context_tokens: int, cached_blocks: int, computed_tokens: int) -> int:
        """vLLM's `get_num_new_matched_tokens`: tokens the store can provide beyond the
        `computed_tokens` vLLM's own prefix cache already holds (a multiple of its page)."""
        blocks = min(cached_blocks, restorable_blocks(context_tokens, self.block_tokens))
        return max(0, blocks * self.block_tokens - computed_tokens)

    def pages_of(self, block_index: int, page_ids: Sequence[int]) -> list[int]:
        """The vLLM pages (of a request's page table) that hold stored block `block_index`."""
        first = block_index * self.pages_per_block
        pages = list(page_ids[first : first + self.pages_per_block])
        if len(pages) != self.pages_per_block:
            raise ValueError(
                f"block {block_index} needs pages {first}..{first + self.pages_per_block - 1}; "
                f"the request has {len(page_ids)}"
            )
        return pages
