"""Builds small Llama-architecture chat models in Hugging Face format, offline and reproducibly.

The torch engine needs a real model (real tokenizer, real KV cache) without network access,
so this module writes one from scratch: a byte-level BPE tokenizer trained on a generated
shopping/support/payments corpus (English and Chinese), a ChatML-style chat template, and
Llama weights from a fixed seed, optionally trained for a few hundred steps so the tiny model
answers with word-like text. The folder loads with `AutoModelForCausalLM` /
`AutoTokenizer` and has the layout vLLM expects.

The trained tiny model ends a chat answer with <|im_end|> (an EOS id) after a sentence or
two, while a plain-text prompt (no chat template) keeps going until max_tokens under greedy
decoding: tests that need long streams use plain prompts.

Rebuilding on the same machine gives byte-identical files (same model version). Trained
weights depend on the CPU's floating-point kernels, so another kind of CPU may produce a
different (equally valid) model: copy the folder rather than rebuilding when two machines
must share one model version.
"""

from __future__ import annotations

import json
import os
import random
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Iterator

BOS = "<|begin_of_text|>"
EOT = "<|end_of_text|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (BOS, EOT, IM_START, IM_END)  # ids 0..3, in this order

# ChatML with a leading BOS. Non-string content (multi-part messages) is not supported.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

SEED = 20240611


@dataclass(frozen=True)
class Preset:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    layers: int
    heads: int
    max_position_embeddings: int
    train_steps: int  # 0 keeps the random initialisation
    train_batch: int = 8
    train_seq_len: int = 128
    learning_rate: float = 4e-3


PRESETS: dict[str, Preset] = {
    # Two heads of 32: vLLM's CPU attention takes no head size under 32, so the one default
    # model folder serves the torch engine and vLLM alike.
    "tiny": Preset(512, 64, 176, 2, 2, 2048, train_steps=200),
    # Large enough that a decode step costs a few ms on a CPU core, so benchmarks measure
    # the mesh under real compute rather than relay overhead; untrained to build fast.
    "bench": Preset(2048, 256, 768, 4, 4, 8192, train_steps=0),
}

# --- corpus -----------------------------------------------------------------------------
# Each intent pairs a question with a fitting answer (English, then Chinese), so a trained
# model learns that answers follow from questions.
_INTENTS = (
    (
        "Where is my order {order}?",
        "Your order {order} has shipped and will arrive in {n} days.",
        "我的订单{order}在哪里？",
        "您的订单{order}已经发货，预计{n}天到达。",
    ),
    (
        "I want to return {item}.",
        "You can return {item} within 30 days for a full refund.",
        "我想退{zitem}。",
        "{zitem}可以在七天内退货，退款会原路返回。",
    ),
    ("Can I pay with {pay}?", "Yes, we accept {pay} at checkout.", "可以用{zpay}付款吗？", "可以，结账时支持{zpay}。"),
    (
        "My payment failed. What should I do?",
        "Please check your card details and try again, or choose another payment method.",
        "支付失败了怎么办？",
        "请检查银行卡信息后重试，或者换一种支付方式。",
    ),
    (
        "Is {item} in stock?",
        "Yes, {item} is in stock and ships today.",
        "{zitem}有货吗？",
        "有货，{zitem}今天就可以发货。",
    ),
    (
        "I was charged twice for {item}.",
        "Sorry about that. The extra charge for {item} will be refunded within {n} days.",
        "{zitem}被扣了两次钱。",
        "非常抱歉，多扣的款项会在{n}天内退回。",
    ),
    (
        "How do I change my delivery address?",
        "Open your order in the app and tap Change address before it ships.",
        "怎么修改收货地址？",
        "请在发货前打开订单，点击修改地址。",
    ),
    (
        "Do you have a discount on {item}?",
        "Yes, {item} is {n}0% off during the sale this week.",
        "{zitem}有优惠吗？",
        "有的，本周活动{zitem}打{n}折。",
    ),
)
_ITEMS = (
    "a blue jacket",
    "the running shoes",
    "a phone case",
    "the coffee maker",
    "a gift card",
    "this laptop",
    "the winter coat",
    "the headphones",
    "a green sweater",
)
_ZITEMS = ("蓝色外套", "跑步鞋", "手机壳", "咖啡机", "礼品卡", "这台电脑", "冬季大衣", "耳机", "绿色毛衣")
_PAYS = ("a credit card", "PayPal", "Apple Pay", "a bank transfer", "Alipay", "WeChat Pay")
_ZPAYS = ("信用卡", "支付宝", "微信支付", "银行转账", "花呗")
_PROSE = (
    "The customer paid for {item} with {pay}.",
    "Support answered the question about {item}.",
    "We shipped {item} to the new address.",
    "Many people buy {item} during the sale.",
    "顾客用{zpay}买了{zitem}。",
    "客服回答了关于{zitem}的问题。",
)
_SYSTEMS = (
    "You are a helpful shopping assistant.",
    "You answer questions about orders and payments.",
    "你是一个购物客服助手。",
    "",
)


def _dialogue(rng: random.Random) -> list[dict[str, str]]:
    q, a, zq, za = rng.choice(_INTENTS)
    slots = dict(
        order=str(rng.randrange(10000, 99999)),
        n=str(rng.randrange(2, 9)),
        item=rng.choice(_ITEMS),
        zitem=rng.choice(_ZITEMS),
        pay=rng.choice(_PAYS),
        zpay=rng.choice(_ZPAYS),
    )
    chinese = rng.random() < 0.3
    messages = []
    system = rng.choice(_SYSTEMS)
    if system:
        messages.append({"role": "system", "content": system})
    messages.append({"role": "user", "content": (zq if chinese else q).format(**slots)})
    messages.append({"role": "assistant", "content": (za if chinese else a).format(**slots)})
    return messages


def render_chat(messages: list[dict[str, str]], add_generation_prompt: bool = False) -> str:
    """The chat template in plain Python (the Jinja one renders the same text)."""
    text = BOS + "".join(f"{IM_START}{m['role']}\n{m['content']}{IM_END}\n" for m in messages)
    return text + (f"{IM_START}assistant\n" if add_generation_prompt else "")


def _sentences(rng: random.Random) -> list[str]:
    """Prose for the plain-text stream: the intents' questions and answers as sentences."""
    dialogue = [m["content"] for m in _dialogue(rng) if m["role"] != "system"]
    return dialogue + [
        s.format(item=rng.choice(_ITEMS), pay=rng.choice(_PAYS), zitem=rng.choice(_ZITEMS), zpay=rng.choice(_ZPAYS))
        for s in rng.sample(_PROSE, 2)
    ]


def chats(n: int = 3000, seed: int = SEED) -> list[str]:
    """Deterministic rendered chats: one system/user/assistant exchange each."""
    rng = random.Random(seed)
    return [render_chat(_dialogue(rng)) for _ in range(n)]


def prose(n: int = 600, seed: int = SEED + 1) -> list[str]:
    """Deterministic paragraphs of plain text, with no special tokens."""
    rng = random.Random(seed)
    paragraphs = []
    for _ in range(n):
        words = [s for _ in range(rng.randrange(1, 4)) for s in _sentences(rng)]
        paragraphs.append("".join(w if w[-1] in "。？" else w + " " for w in words).strip() + "\n\n")
    return paragraphs


def corpus() -> list[str]:
    """Everything the tokenizer is trained on."""
    return chats() + prose()


# --- tokenizer --------------------------------------------------------------------------
def train_tokenizer(texts: list[str], vocab_size: int):
    """A byte-level BPE tokenizer with the special tokens at ids 0..3."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


# --- weights ----------------------------------------------------------------------------
@contextmanager
def _isolated_torch(threads: int = 1) -> Iterator[None]:
    """Single-threaded, fork of the global RNG: results do not depend on the caller's
    thread count or random state, and the caller's state is left as it was."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(SEED)
            yield
    finally:
        torch.set_num_threads(before)


def _config_dict(p: Preset, vocab_size: int) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab_size,
        "hidden_size": p.hidden_size,
        "intermediate_size": p.intermediate_size,
        "num_hidden_layers": p.layers,
        "num_attention_heads": p.heads,
        "num_key_value_heads": p.heads,
        "head_dim": p.hidden_size // p.heads,
        "hidden_act": "silu",
        "max_position_embeddings": p.max_position_embeddings,
        "initializer_range": 0.02,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "use_cache": True,
        "bos_token_id": 0,
        "eos_token_id": [3, 1],
        "pad_token_id": 1,
        "torch_dtype": "float32",
    }


def _train(model, chat_ids: list[int], prose_ids: list[int], p: Preset, progress: Callable[[str], None]) -> float:
    """A short, deterministic language-model fit; returns the last loss.

    Each batch is half chats, half prose, from separate token streams. Chat windows start at
    a chat's BOS, so the model only learns to end a turn (EOS) inside the chat format; prose
    holds no special tokens, so a plain-text prompt continues as long as asked.
    """
    import torch

    chats_t = torch.tensor(chat_ids, dtype=torch.long)
    prose_t = torch.tensor(prose_ids, dtype=torch.long)
    n = p.train_seq_len
    chat_starts = (chats_t[: len(chats_t) - n] == 0).nonzero().flatten()
    gen = torch.Generator().manual_seed(SEED)
    opt = torch.optim.AdamW(model.parameters(), lr=p.learning_rate, weight_decay=0.0, foreach=False)
    model.train()
    loss_value = float("nan")
    half = p.train_batch // 2
    for step in range(p.train_steps):
        picks = torch.randint(0, len(chat_starts), (half,), generator=gen)
        offsets = torch.randint(0, len(prose_t) - n, (p.train_batch - half,), generator=gen)
        batch = torch.stack(
            [chats_t[s : s + n] for s in chat_starts[picks].tolist()] + [prose_t[s : s + n] for s in offsets.tolist()]
        )
        lr = p.learning_rate * min(1.0, (step + 1) / 20) * (1 - step / p.train_steps) ** 0.5
        for group in opt.param_groups:
            group["lr"] = lr
        loss = model(input_ids=batch, labels=batch).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        loss_value = loss.item()
        if (step + 1) % 100 == 0 or step + 1 == p.train_steps:
            progress(f"training weights: step {step + 1}/{p.train_steps}, loss {loss_value:.3f}")
    model.eval()
    return loss_value


def _build_weights(
    p: Preset, vocab_size: int, streams: tuple[list[int], list[int]], progress: Callable[[str], None]
) -> tuple[dict, int, float | None]:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    progress("initialising weights")
    config = LlamaConfig.from_dict(_config_dict(p, vocab_size))
    with _isolated_torch():
        model = LlamaForCausalLM._from_config(config, attn_implementation="eager", dtype=torch.float32)
        loss = _train(model, *streams, p, progress) if p.train_steps else None
    tensors = {k: v.detach().contiguous().clone() for k, v in model.state_dict().items()}
    params = sum(t.numel() for t in tensors.values())
    return tensors, params, loss


# --- files ------------------------------------------------------------------------------
def _write(path: Path, data: bytes) -> None:
    # Write-then-rename so a reader (or a concurrent builder) never sees a half-written file.
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _json(obj: dict) -> bytes:
    return (json.dumps(obj, indent=2, ensure_ascii=False, sort_keys=True) + "\n").encode()


def build_tiny_model(out_dir: Path, preset: str = "tiny", progress: Callable[[str], None] | None = None) -> Path:
    """Write a complete model folder for `preset` into `out_dir` and return it."""
    from safetensors.torch import save

    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
    p = PRESETS[preset]
    say = progress or (lambda _msg: None)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()

    say("generating corpus")
    chat_texts, prose_texts = chats(), prose()
    say("training tokenizer")
    tok = train_tokenizer(chat_texts + prose_texts, p.vocab_size)
    vocab_size = tok.get_vocab_size()
    for i, special in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(special) == i, special
    streams: tuple[list[int], list[int]] = ([], [])
    if p.train_steps:
        streams = tuple([i for enc in tok.encode_batch(texts) for i in enc.ids] for texts in (chat_texts, prose_texts))

    tensors, params, loss = _build_weights(p, vocab_size, streams, say)

    say("writing files")
    _write(out_dir / "tokenizer.json", tok.to_str(pretty=False).encode())
    _write(
        out_dir / "tokenizer_config.json",
        _json(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": BOS,
                "eos_token": IM_END,
                "pad_token": EOT,
                "add_bos_token": False,
                "add_eos_token": False,
                "clean_up_tokenization_spaces": False,
                "model_max_length": p.max_position_embeddings,
                "chat_template": CHAT_TEMPLATE,
            }
        ),
    )
    _write(
        out_dir / "special_tokens_map.json",
        _json(
            {
                "bos_token": BOS,
                "eos_token": IM_END,
                "pad_token": EOT,
                "additional_special_tokens": [IM_START, IM_END],
            }
        ),
    )
    _write(out_dir / "config.json", _json(_config_dict(p, vocab_size)))
    _write(
        out_dir / "generation_config.json",
        _json(
            {
                "bos_token_id": 0,
                "eos_token_id": [3, 1],
                "pad_token_id": 1,
                "do_sample": False,
            }
        ),
    )
    _write(out_dir / "model.safetensors", save(tensors, metadata={"format": "pt"}))
    _write(
        out_dir / "ballast.json",
        _json(
            {
                "preset": preset,
                "spec": asdict(p),
                "parameters": params,
                "vocab_size": vocab_size,
                "train_steps": p.train_steps,
                "final_loss": None if loss is None else round(loss, 4),
            }
        ),
    )
    say(f"done in {time.monotonic() - started:.1f}s ({params} parameters)")
    return out_dir


def built_preset(out_dir: Path) -> tuple[str, bool] | None:
    """(the preset a folder was built from, whether it matches that preset today), or None for
    a folder Ballast did not build (a user's own model: never rebuilt over)."""
    try:
        marker = json.loads((Path(out_dir) / "ballast.json").read_text())
    except (OSError, ValueError):
        return None
    preset = marker.get("preset")
    if preset not in PRESETS:
        return None
    current = marker.get("spec") == asdict(PRESETS[preset]) and (Path(out_dir) / "model.safetensors").exists()
    return preset, current


def ensure_tiny_model(out_dir: Path, preset: str = "tiny", progress: Callable[[str], None] | None = None) -> Path:
    """Build the model unless `out_dir` already holds a complete, current one of this preset
    (a folder built from an older definition of the preset is rebuilt)."""
    if built_preset(out_dir) == (preset, True):
        return Path(out_dir)
    return build_tiny_model(out_dir, preset, progress)
