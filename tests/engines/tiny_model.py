"""A tiny Llama for real vLLM engines on the CPU, built from nothing (no model hub is reachable):
random weights (seeded), a byte-level BPE tokenizer trained here on a few sentences, and a chat
template. Run with the vLLM virtualenv's Python: `python tiny_model.py DIR [HIDDEN LAYERS]` (a
larger model of the same shape: bench/real_gateway.py sizes it so that prefill dominates).

The model's answers are noise; what the tests need from it is a real engine's KV cache: real
block hashes, evictions and `cached_tokens` counts."""

from __future__ import annotations

import json
import sys
from pathlib import Path

CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "A router sends each prompt to the worker that already holds its cache.",
    "Blocks of tokens are hashed in a chain, each hash covering its parent.",
    "You are a helpful assistant. Answer briefly and precisely.",
    "Once upon a time there was a small engine that ran on two cores.",
    "0123456789 abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ",
]


def build_tokenizer(folder: Path) -> None:
    """The tokenizer alone (`tokenizer.json`, `tokenizer_config.json`): it needs only the
    `tokenizers` wheel, so that a picker's bench can tokenize as the engines' picker does."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer(models.BPE(unk_token=None))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=1024, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(CORPUS * 20, trainer=trainer)
    # BOS (id 0) starts every text prompt, as a Llama tokenizer's post-processor does.
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                             special_tokens=[("<s>", 0)])
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
        "model_max_length": 2048, "chat_template": CHAT_TEMPLATE,
    }))


def build(folder: Path, hidden_size: int = 128, layers: int = 2) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    build_tokenizer(folder)
    torch.manual_seed(0)
    heads = max(4, hidden_size // 32)  # heads of 32 dimensions, two queries to a KV head
    config = LlamaConfig(vocab_size=1024, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads // 2,
                         max_position_embeddings=2048,
                         bos_token_id=0, eos_token_id=1, torch_dtype="float32")
    LlamaForCausalLM(config).save_pretrained(folder, safe_serialization=True)


if __name__ == "__main__":
    build(Path(sys.argv[1]), *map(int, sys.argv[2:4]))
