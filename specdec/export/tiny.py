"""Tiny random models with a real byte-level BPE tokenizer, built in-process for tests and smoke runs."""
from __future__ import annotations

from pathlib import Path

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Speculative decoding drafts tokens with a small model and verifies them with a large one.",
    "def add(a, b):\n    return a + b\n",
    "Once upon a time there was a tiny model that wanted to speak.",
    "Summarize the following text in one sentence.",
]

FAMILY_CONFIGS = {
    "llama": dict(num_attention_heads=4, num_key_value_heads=2, intermediate_size=64, tie_word_embeddings=True),
    "qwen2": dict(num_attention_heads=4, num_key_value_heads=2, intermediate_size=64),
    "qwen3": dict(num_attention_heads=4, num_key_value_heads=2, intermediate_size=64, head_dim=8),
    "mistral": dict(num_attention_heads=4, num_key_value_heads=1, intermediate_size=64, sliding_window=None),
    "phi3": dict(num_attention_heads=4, num_key_value_heads=2, intermediate_size=64),
    "gpt2": dict(n_head=4),
}
SIZE_NAMES = ("hidden_size", "num_hidden_layers", "max_position_embeddings")  # hidden size, layers, positions
FAMILY_SIZE_NAMES = {"gpt2": ("n_embd", "n_layer", "n_positions")}  # families that name them otherwise


def tiny_tokenizer(vocab_size: int):
    """A byte-level BPE tokenizer trained on a few sentences, as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    core.train_from_iterator(CORPUS * 4, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=core, bos_token="<|im_start|>", eos_token="<|im_end|>", pad_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
    )


def tiny_model(family: str, vocab_size: int, layers: int = 2, hidden: int = 32, seed: int = 0, positions: int = 512,
               init_range: float = 0.02, **config):
    """A random `family` model; `config`: fields that replace FAMILY_CONFIGS' (head_dim=16, ...)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    special = dict(bos_token_id=1, eos_token_id=2, pad_token_id=0, initializer_range=init_range)
    sizes = dict(zip(FAMILY_SIZE_NAMES.get(family, SIZE_NAMES), (hidden, layers, positions)))
    fields = {**FAMILY_CONFIGS[family], **config}
    config = AutoConfig.for_model(family, vocab_size=vocab_size, **sizes, **fields, **special)
    return AutoModelForCausalLM.from_config(config).eval()


def save_tiny(folder: str | Path, family: str = "llama", layers: int = 2, seed: int = 0, hidden: int = 32,
              init_range: float = 0.02, vocab_size: int = 320, **config) -> Path:
    """Write a random `family` model and its tokenizer to `folder` (save_pretrained layout).
    A larger `init_range` gives peakier distributions (useful for sampling tests)."""
    folder = Path(folder)
    tokenizer = tiny_tokenizer(vocab_size)
    model = tiny_model(family, len(tokenizer), layers=layers, hidden=hidden, seed=seed, init_range=init_range, **config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def snap_to_gguf_grids(model, q80: bool = False, mixed: bool = False) -> None:
    """Move a LLaMA-layout model's weights onto the grids a GGUF export has: every Linear weight [N, K] onto Q4_1
    levels d·q + m (q in 0..15, per 32 along K; or with q80 onto Q8_0's, as a Q8_0 GGUF's are; or with mixed onto a
    Q4_K_M file's mix, _mixed_grid), the tied embedding onto Q8_0 levels d·q (q in −127..127), as the default
    model's are (with mixed onto Q6_K's, as a Q4_K_M file's output)."""
    import torch

    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Linear) and "lm_head" not in name:
                if mixed:
                    layer = int(name.split("layers.")[1].split(".")[0])
                    module.weight.copy_(_mixed_grid(name.rsplit(".", 1)[-1], layer)(module.weight))
                    continue
                if q80:
                    module.weight.copy_(_q8_0(module.weight))
                    continue
                w = module.weight.reshape(module.weight.shape[0], -1, 32)
                low, high = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
                step = _half(torch.where(high > low, (high - low) / 15, torch.ones_like(low)))
                low = _half(low)
                codes = torch.clamp(torch.round((w - low) / step), 0, 15)
                module.weight.copy_((codes * step + low).reshape(module.weight.shape))
        table = model.get_input_embeddings().weight
        table.copy_(_q6_k(table) if mixed else _q8_0(table))  # a K-quant file's tied output: Q6_K


def _mixed_grid(projection: str, layer: int):
    """The snapper of a projection in a K-quant mix that reaches every blk kind, as llama.cpp's Q4_K_M mixes them:
    gate/up Q4_K (blk4); in even layers q/k Q5_0 beside v Q8_0 (blk5 and blk8), o Q5_0 and down Q5_1 (blk5); in odd
    ones q/k Q4_K beside v Q6_K (packed q/k/v on two grids: blk4 and blk6 apart), o and down Q6_K (blk6)."""
    odd = layer % 2
    grids = {"q_proj": _q4_k if odd else _q5_0, "k_proj": _q4_k if odd else _q5_0, "v_proj": _q6_k if odd else _q8_0,
             "o_proj": _q6_k if odd else _q5_0, "gate_proj": _q4_k, "up_proj": _q4_k,
             "down_proj": _q6_k if odd else _q5_1}
    return grids[projection]


def _q5_0(weight):
    """weight [N, K] on Q5_0 levels d·q (q in −16..15, d = fp16(x / −16) for the block's x of largest |x|)."""
    import torch

    e = weight.reshape(weight.shape[0], -1, 32)
    extreme = e.gather(-1, e.abs().argmax(-1, keepdim=True))
    step = _half(extreme / -16)
    step = torch.where(step != 0, step, torch.ones_like(step))
    return (torch.clamp(torch.round(e / step), -16, 15) * step).reshape(weight.shape)


def _q5_1(weight):
    """weight [N, K] on Q5_1 levels d·q + m (q in 0..31, d and m fp16 per 32 along K), rounded once in float32."""
    import torch

    e = weight.reshape(weight.shape[0], -1, 32)
    low, high = _half(e.amin(-1, keepdim=True)), e.amax(-1, keepdim=True)
    step = _half(torch.where(high > low, (high - low) / 31, torch.ones_like(low)))
    return (torch.clamp(torch.round((e - low) / step), 0, 31) * step + low).reshape(weight.shape)


def _super_blocks(weight, sub: int):
    """weight [N, K] -> [N, super-blocks, sub-blocks, sub]: K-quant super-blocks of 256 along K (or all of K where
    it is shorter)."""
    per = min(256, weight.shape[1]) // sub
    return weight.reshape(weight.shape[0], -1, per, sub)


def _q6_k(weight):
    """weight [N, K] on Q6_K levels: per 16 along K, d·s·q (q in −32..31, s an int8 scale of the sub-block, d an
    fp16 scale of the super-block), exact in float32."""
    import torch

    e = _super_blocks(weight, 16)
    extreme = e.gather(-1, e.abs().argmax(-1, keepdim=True))  # [N, S, 16, 1]
    wanted = extreme / -32
    d = _half(wanted.abs().amax(-2, keepdim=True) / 127)
    d = torch.where(d > 0, d, torch.ones_like(d))
    scale = d * torch.clamp(torch.round(wanted / d), -128, 127)
    safe = torch.where(scale != 0, scale, torch.ones_like(scale))
    return (torch.clamp(torch.round(e / safe), -32, 31) * scale).reshape(weight.shape)


def _q4_k(weight):
    """weight [N, K] on Q4_K levels: per 32 along K, d·s·q − dmin·m (q in 0..15, s and m 6-bit, d and dmin fp16 per
    super-block), rounded once in float32 as a GGUF's dequantization rounds."""
    import torch

    e = _super_blocks(weight, 32)
    low = torch.clamp(e.amin(-1, keepdim=True), max=0)
    wanted = (e.amax(-1, keepdim=True) - low) / 15
    d, dmin = _half(wanted.amax(-2, keepdim=True) / 63), _half((-low).amax(-2, keepdim=True) / 63)
    d, dmin = torch.where(d > 0, d, torch.ones_like(d)), torch.where(dmin > 0, dmin, torch.ones_like(dmin))
    scale = d * torch.clamp(torch.round(wanted / d), 0, 63)
    minimum = dmin * torch.clamp(torch.round(-low / dmin), 0, 63)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    return (torch.clamp(torch.round((e + minimum) / safe), 0, 15) * scale - minimum).reshape(weight.shape)


def _q8_0(weight):
    """weight [N, K] on Q8_0 levels d·q (q in −127..127, d an fp16 value per 32 along K)."""
    import torch

    e = weight.reshape(weight.shape[0], -1, 32)
    step = e.abs().amax(-1, keepdim=True) / 127
    step = torch.where(step > 0, step, torch.ones_like(step))  # all-zero rows (the padding token's)
    step = _half(step, down=True)  # not above max|e| / 127: the largest code stays ±127
    return (torch.clamp(torch.round(e / step), -127, 127) * step).reshape(weight.shape)


def _half(x, down: bool = False):
    """x (fp32, positive where down) as the nearest fp16 value, a GGUF block's scale or minimum; with down, the
    largest fp16 value not above it."""
    import torch

    half = x.half()
    if down:
        half = torch.where(half.float() > x, (half.view(torch.int16) - 1).view(torch.float16), half)
    return half.float()


def save_tiny_on_grids(folder: str | Path, q80: bool = False, mixed: bool = False, **options) -> Path:
    """save_tiny, then the weights snapped to the GGUF grids (snap_to_gguf_grids) and saved again."""
    from transformers import AutoModelForCausalLM

    folder = save_tiny(folder, **options)
    model = AutoModelForCausalLM.from_pretrained(folder)
    snap_to_gguf_grids(model, q80, mixed)
    model.save_pretrained(folder)
    return folder


def save_tiny_in(folder: str | Path, dtype: str, **options) -> Path:
    """save_tiny, then the checkpoint saved again in `dtype` ("bfloat16", "float16"): a half-precision checkpoint,
    as most hub models are."""
    import torch
    from transformers import AutoModelForCausalLM

    folder = save_tiny(folder, **options)
    AutoModelForCausalLM.from_pretrained(folder).to(getattr(torch, dtype)).save_pretrained(folder)
    return folder
