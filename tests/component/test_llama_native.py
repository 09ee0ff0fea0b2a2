"""The plain-torch Llama-family decoder (services.worker.torch.llama) against transformers.

On the tiny Llama: prefill logits and KV, chunked prefill, and batched greedy decoding of
sequences of different lengths. On a random Qwen2 (q/k/v bias, grouped-query attention,
tied embeddings, a non-default rope theta): prefill and decode logits. Each model runs twice:
with its KV in a KVPool (decode attention batched) and without (attention per sequence).
Then `supports()`, the SequenceKV buffers and the pool's slots.
"""

from __future__ import annotations

import gc
import json

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    MistralConfig,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from services.worker.torch.llama import KVPool, LlamaModel, SequenceKV, supports
from services.worker.tiny_model import render_chat
from tests.model_fixtures import tiny_model_dir  # noqa: F401

ATOL = 1e-4
PROMPTS = [
    "The customer paid for the winter coat",
    render_chat([{"role": "user", "content": "Where is my order 12345?"}], add_generation_prompt=True),
    "我想退跑步鞋。",
    render_chat(
        [
            {"role": "system", "content": "You are a helpful shopping assistant."},
            {"role": "user", "content": "Can I pay with PayPal?"},
        ],
        add_generation_prompt=True,
    ),
]


def native(model_dir, pooled: bool) -> LlamaModel:
    model = LlamaModel(model_dir)
    if pooled:
        assert model.attach_pool(slots=16, max_bytes=16 << 20) is not None
    return model


@pytest.fixture(scope="module", params=[False, True], ids=["per-sequence", "pooled"])
def tiny(tiny_model_dir, request):
    """(native model, transformers model, prompt ids) for the tiny Llama."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir, local_files_only=True)
    ids = [tokenizer.encode(p, add_special_tokens=False) for p in PROMPTS]
    assert len({len(i) for i in ids}) == len(ids), "prompts should differ in length"
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32, local_files_only=True).eval()
    return native(tiny_model_dir, request.param), hf, ids


def hf_forward(hf, ids: list[int]):
    with torch.inference_mode():
        return hf(input_ids=torch.tensor([ids]), use_cache=True)


def greedy(model: LlamaModel, prompts: list[list[int]], steps: int) -> list[list[int]]:
    """Greedy tokens of every prompt, all decode steps run as one batch."""
    caches = [model.new_cache() for _ in prompts]
    tokens = [int(model.prefill(c, p).argmax()) for c, p in zip(caches, prompts)]
    out = [[t] for t in tokens]
    for _ in range(steps - 1):
        tokens = model.decode(caches, tokens).argmax(-1).tolist()
        for row, t in zip(out, tokens):
            row.append(t)
    for cache, prompt in zip(caches, prompts):
        assert cache.length == len(prompt) + steps - 1
    return out


# --- the tiny Llama ---------------------------------------------------------------------------
def test_prefill_logits_and_kv_match_transformers(tiny):
    model, hf, prompts = tiny
    for ids in prompts:
        cache = model.new_cache(4)  # small on purpose: prefill must grow it
        logits = model.prefill(cache, ids)
        expected = hf_forward(hf, ids)
        torch.testing.assert_close(logits, expected.logits[0, -1], atol=ATOL, rtol=0)
        assert cache.length == len(ids)
        # The cache holds what transformers' does (rotated keys), so the KV store can mix them.
        for mine, theirs in zip(cache.layers, expected.past_key_values.layers):
            torch.testing.assert_close(mine.keys, theirs.keys, atol=ATOL, rtol=0)
            torch.testing.assert_close(mine.values, theirs.values, atol=ATOL, rtol=0)


def test_chunked_prefill_equals_single_prefill(tiny):
    model, _hf, prompts = tiny
    ids = prompts[3]
    whole = model.new_cache()
    expected = model.prefill(whole, ids)
    for split in (1, len(ids) // 2, len(ids) - 1):
        chunked = model.new_cache(split)  # the second chunk also grows the buffers
        model.prefill(chunked, ids[:split])
        logits = model.prefill(chunked, ids[split:])
        torch.testing.assert_close(logits, expected, atol=1e-5, rtol=0)
        assert chunked.length == whole.length == len(ids)
        for mine, theirs in zip(chunked.layers, whole.layers):
            torch.testing.assert_close(mine.keys, theirs.keys, atol=1e-5, rtol=0)
            torch.testing.assert_close(mine.values, theirs.values, atol=1e-5, rtol=0)


def test_prefills_run_together_equal_prefills_run_alone(tiny):
    """Several sequences, some with a cached past, prefilled in one pass: each one's logits
    and KV are those of its own prefill."""
    model, _hf, prompts = tiny
    alone = []
    for ids in prompts:
        cache = model.new_cache()
        model.prefill(cache, ids[:2])  # a past for the second chunk to attend to
        alone.append((cache, model.prefill(cache, ids[2:])))
    caches = [model.new_cache() for _ in prompts]
    model.prefill_many(caches, [ids[:2] for ids in prompts])
    logits = model.prefill_many(caches, [ids[2:] for ids in prompts])
    assert logits.shape[0] == len(prompts)
    for (cache, expected), mine, row in zip(alone, caches, logits):
        torch.testing.assert_close(row, expected, atol=1e-5, rtol=0)
        assert mine.length == cache.length
        for a, b in zip(mine.layers, cache.layers):
            torch.testing.assert_close(a.keys, b.keys, atol=1e-5, rtol=0)
            torch.testing.assert_close(a.values, b.values, atol=1e-5, rtol=0)


def test_batched_greedy_decode_matches_transformers_generate(tiny):
    model, hf, prompts = tiny
    steps = 20
    native = greedy(model, prompts, steps)
    config = GenerationConfig(do_sample=False, max_new_tokens=steps, eos_token_id=[], pad_token_id=1)
    for ids, mine in zip(prompts, native):
        with torch.inference_mode():
            out = hf.generate(torch.tensor([ids]), generation_config=config)
        theirs = out[0, len(ids) :].tolist()
        assert len(theirs) == steps
        assert mine == theirs
    # Batching is not cosmetic: alone, each sequence decodes the same tokens.
    assert [greedy(model, [p], steps)[0] for p in prompts] == native


def test_batched_decode_logits_match_transformers(tiny):
    model, hf, prompts = tiny
    caches = [model.new_cache() for _ in prompts]
    for cache, ids in zip(caches, prompts):
        model.prefill(cache, ids)
    follow = [5, 17, 42, 99]
    logits = model.decode(caches, follow)
    assert logits.shape == (len(prompts), model.vocab_size)
    for row, (ids, token) in enumerate(zip(prompts, follow)):
        expected = hf_forward(hf, ids + [token]).logits[0, -1]
        torch.testing.assert_close(logits[row], expected, atol=ATOL, rtol=0)


# --- a random Qwen2: bias, GQA, tied embeddings ------------------------------------------------
@pytest.fixture(scope="module", params=[False, True], ids=["per-sequence", "pooled"])
def qwen2(tmp_path_factory, request):
    torch.manual_seed(1234)
    config = Qwen2Config(
        vocab_size=101,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        # Weights large enough that logits are O(1): a wrong bias or rope
        # theta then moves them by far more than ATOL.
        initializer_range=0.2,
        rope_parameters={"rope_type": "default", "rope_theta": 500.0},
    )
    hf = Qwen2ForCausalLM(config).eval()
    with torch.no_grad():  # non-trivial biases and norm scales (they initialise to 0 and 1)
        for name, param in hf.named_parameters():
            if name.endswith("bias"):
                param.normal_(0.0, 0.5)
            elif "norm" in name:
                param.uniform_(0.5, 1.5)
    path = tmp_path_factory.mktemp("qwen2")
    hf.save_pretrained(path, safe_serialization=True)
    saved = json.loads((path / "config.json").read_text())
    assert saved["architectures"] == ["Qwen2ForCausalLM"] and saved["tie_word_embeddings"]
    return native(path, request.param), hf


def test_qwen2_weights_are_the_ones_this_test_means(qwen2):
    model, _hf = qwen2
    assert model.kv_heads == 2 and model.heads == 4
    assert model.lm_head is model.embed  # no lm_head.weight in the file: tied
    assert model.layers[0]["q_bias"] is not None and model.layers[0]["q_bias"].abs().sum() > 0


def test_qwen2_prefill_and_decode_logits_match_transformers(qwen2):
    model, hf = qwen2
    generator = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 101, (n,), generator=generator).tolist() for n in (9, 4)]
    caches = [model.new_cache(8) for _ in prompts]
    assert all(cache.pool is model.pool for cache in caches)
    tokens = []
    for cache, ids in zip(caches, prompts):
        logits = model.prefill(cache, ids)
        torch.testing.assert_close(logits, hf_forward(hf, ids).logits[0, -1], atol=ATOL, rtol=0)
        tokens.append(int(logits.argmax()))
    sequences = [ids + [t] for ids, t in zip(prompts, tokens)]
    for _ in range(4):
        logits = model.decode(caches, tokens)
        tokens = []
        for row, seq in enumerate(sequences):
            expected = hf_forward(hf, seq).logits[0, -1]
            torch.testing.assert_close(logits[row], expected, atol=ATOL, rtol=0)
            tokens.append(int(logits[row].argmax()))
            seq.append(tokens[-1])


# --- supports() ---------------------------------------------------------------------------------
def test_supports_accepts_the_tiny_model(tiny_model_dir):
    assert supports(json.loads((tiny_model_dir / "config.json").read_text()))


@pytest.mark.parametrize(
    "change",
    [
        {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}},
        {"rope_parameters": None, "rope_scaling": {"type": "dynamic", "factor": 2.0}},
        {
            "rope_parameters": {
                "rope_type": "llama3",
                "factor": 8.0,
                "rope_theta": 500000.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            }
        },
        {"architectures": ["GPT2LMHeadModel"]},
        {"architectures": ["Qwen3ForCausalLM"]},
        {"architectures": []},
    ],
    ids=["linear-rope", "legacy-dynamic-rope", "llama3-rope", "gpt2", "qwen3", "no-architecture"],
)
def test_supports_rejects_what_it_does_not_compute(tiny_model_dir, change):
    config = json.loads((tiny_model_dir / "config.json").read_text())
    config.update(change)
    assert not supports(config)


def test_supports_rejects_mistral_with_a_sliding_window():
    config = MistralConfig(sliding_window=4096).to_dict()
    config["architectures"] = ["MistralForCausalLM"]
    assert not supports(config)
    config["sliding_window"] = None
    assert supports(config)  # the window, not the architecture, is what is refused


# --- SequenceKV -----------------------------------------------------------------------------------
def filled_kv(layers: int = 2, heads: int = 2, tokens: int = 5, dim: int = 3, capacity: int = 6):
    generator = torch.Generator().manual_seed(3)
    keys = [torch.randn(heads, capacity, dim, generator=generator) for _ in range(layers)]
    values = [torch.randn(heads, capacity, dim, generator=generator) for _ in range(layers)]
    return SequenceKV(keys, values, tokens)


def test_layers_are_views_of_the_filled_part():
    kv = filled_kv()
    layers = kv.layers
    assert len(layers) == 2
    for layer, keys, values in zip(layers, kv.keys, kv.values):
        assert layer.keys.shape == layer.values.shape == (1, 2, 5, 3)
        assert torch.equal(layer.keys[0], keys[:, :5]) and torch.equal(layer.values[0], values[:, :5])
    assert kv.get_seq_length() == 5


def test_truncated_is_a_copy():
    kv = filled_kv()
    cut = kv.truncated(3)
    assert cut.length == 3 and cut.layers[0].keys.shape == (1, 2, 3, 3)
    expected_keys = [k[:, :3].clone() for k in kv.keys]
    expected_values = [v[:, :3].clone() for v in kv.values]
    for store in (kv.keys, kv.values):
        for buffer in store:
            buffer.fill_(123.0)  # the original is written afterwards (a decode step, a restore)
    for layer, keys, values in zip(cut.layers, expected_keys, expected_values):
        assert torch.equal(layer.keys[0], keys) and torch.equal(layer.values[0], values)


def test_reserve_grows_and_keeps_the_filled_positions():
    kv = filled_kv(tokens=5, capacity=6)
    before = [(k[:, :5].clone(), v[:, :5].clone()) for k, v in zip(kv.keys, kv.values)]
    old_buffer = kv.keys[0]
    kv.reserve(1)
    assert kv.keys[0] is old_buffer  # room enough: nothing allocated
    kv.reserve(10)
    assert kv.keys[0].shape[1] >= 15 and kv.values[1].shape[1] >= 15
    assert kv.length == 5
    for layer, (keys, values) in zip(kv.layers, before):
        assert torch.equal(layer.keys[0], keys) and torch.equal(layer.values[0], values)


def test_from_pairs_copies_transformers_layout():
    pairs = [(torch.randn(1, 2, 4, 3), torch.randn(1, 2, 4, 3)) for _ in range(2)]
    kv = SequenceKV.from_pairs(pairs)
    assert kv.length == 4
    for layer, (keys, values) in zip(kv.layers, pairs):
        assert torch.equal(layer.keys, keys) and torch.equal(layer.values, values)
    pairs[0][0].zero_()
    assert not torch.equal(kv.layers[0].keys, pairs[0][0])


# --- KVPool -------------------------------------------------------------------------------------
def test_pooled_caches_live_in_slots_and_decode_as_one_batch(tiny_model_dir):
    """Pooled and unpooled sequences decode the same logits; a batch mixing both (the pool
    was full) still does, through the per-sequence path."""
    pooled, plain = native(tiny_model_dir, True), native(tiny_model_dir, False)
    lengths = [3, 11, 7, 20]
    generator = torch.Generator().manual_seed(5)
    prompts = [torch.randint(4, pooled.vocab_size, (n,), generator=generator).tolist() for n in lengths]
    in_pool = [pooled.new_cache() for _ in prompts]
    assert all(c.pool is pooled.pool for c in in_pool) and len({c.slot for c in in_pool}) == len(prompts)
    reference = [plain.new_cache() for _ in prompts]
    pooled.prefill_many(in_pool, prompts)
    plain.prefill_many(reference, prompts)
    tokens = [5, 6, 7, 8]
    for _ in range(6):
        mine, theirs = pooled.decode(in_pool, tokens), plain.decode(reference, tokens)
        torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=0)
        tokens = theirs.argmax(-1).tolist()
    mixed = in_pool[:2] + [SequenceKV.from_pairs([(l.keys, l.values) for l in in_pool[2].layers])]
    assert mixed[2].pool is None
    torch.testing.assert_close(
        pooled.decode(mixed, tokens[:3]), plain.decode(reference[:3], tokens[:3]), atol=1e-5, rtol=0
    )


def test_a_slot_comes_back_only_when_its_cache_is_collected(tiny_model_dir):
    model = native(tiny_model_dir, True)
    pool = model.pool
    cache = model.new_cache()
    views = cache.layers  # what a pending KV save holds, beside the cache itself
    assert pool.free == pool.slots - 1
    del views
    gc.collect()
    assert pool.free == pool.slots - 1  # the cache is still alive: its slot stays taken
    del cache
    gc.collect()
    assert pool.free == pool.slots


def test_a_full_pool_hands_out_caches_of_their_own(tiny_model_dir):
    model = LlamaModel(tiny_model_dir)
    pool = model.attach_pool(slots=2, max_bytes=16 << 20)
    taken = [model.new_cache() for _ in range(3)]
    assert [c.pool is pool for c in taken] == [True, True, False]
    assert model.new_cache(pool.capacity + 1).pool is None  # longer than a slot


def test_a_cache_that_outgrows_its_slot_leaves_the_pool_with_its_tokens(tiny_model_dir):
    model = LlamaModel(tiny_model_dir)
    pool = model.attach_pool(slots=2, max_bytes=2 * 256 * 2 * model.layers_count * model.kv_heads * model.head_dim * 4)
    assert pool.capacity == 256
    cache = model.new_cache()
    ids = [4 + i % 50 for i in range(pool.capacity - 1)]
    model.prefill(cache, ids)
    before = [(l.keys.clone(), l.values.clone()) for l in cache.layers]
    model.decode([cache], [9])  # the last position of the slot
    assert cache.pool is pool
    model.decode([cache], [10])  # one more: out of the slot, into buffers of its own
    assert cache.pool is None and cache.length == pool.capacity + 1
    for layer, (keys, values) in zip(cache.layers, before):
        assert torch.equal(layer.keys[:, :, : len(ids)], keys) and torch.equal(layer.values[:, :, : len(ids)], values)
    assert pool.free == 1  # its slot stays taken while the cache lives (old views may be read)


def test_truncated_and_restored_caches_land_in_the_pool(tiny_model_dir):
    model = native(tiny_model_dir, True)
    cache = model.new_cache()
    model.prefill(cache, [4, 5, 6, 7, 8])
    cut = cache.truncated(3)
    restored = SequenceKV.from_pairs([(l.keys, l.values) for l in cache.layers], model.pool)
    assert cut.pool is model.pool and restored.pool is model.pool
    assert len({cache.slot, cut.slot, restored.slot}) == 3
    assert cut.length == 3 and restored.length == 5
    for a, b in zip(cut.layers, cache.layers):
        assert torch.equal(a.keys, b.keys[:, :, :3]) and torch.equal(a.values, b.values[:, :, :3])


def test_pool_slots_are_zeroed_views():
    pool = KVPool(
        layers=2, slots=3, kv_heads=2, capacity=8, head_dim=4, dtype=torch.float32, device=torch.device("cpu")
    )
    cache = pool.take()
    assert cache.keys[0].shape == (2, 8, 4) and cache.keys[0].data_ptr() == pool.keys[0][cache.slot].data_ptr()
    assert all(float(t.abs().sum()) == 0.0 for t in pool.keys + pool.values)
