"""Writes a byte-level BPE ``tokenizer.json`` sized exactly to a model's vocabulary.

The reference models are random weights made locally, so they have no tokenizer on any hub.
Text still has to map to their token ids and back (the OpenAI gateway counts and decodes
with it), so ``make_model`` trains one here: a byte-level BPE (every byte string encodes, every
id decodes) on a seeded synthetic corpus, padded with reserved tokens up to ``vocab_size`` so
that any id the model can emit decodes to something.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

SPECIAL_TOKENS = ["<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>"]
_SYLLABLES = [
    "ka",
    "lo",
    "mi",
    "ne",
    "su",
    "ta",
    "ri",
    "po",
    "de",
    "fa",
    "gu",
    "hi",
    "jo",
    "ve",
    "wa",
    "xe",
    "yo",
    "zu",
    "ba",
    "ce",
]
_WORDS = [
    "the",
    "a",
    "fleet",
    "worker",
    "move",
    "session",
    "token",
    "model",
    "prompt",
    "decode",
    "prefill",
    "GPU",
]


def _corpus(seed: int, lines: int = 4000) -> Iterator[str]:
    """Deterministic text with enough distinct pairs to fill a few thousand merges."""
    rng = random.Random(seed)
    for _ in range(lines):
        words = []
        for _ in range(rng.randint(4, 16)):
            if rng.random() < 0.3:
                words.append(rng.choice(_WORDS))
            else:
                words.append("".join(rng.choices(_SYLLABLES, k=rng.randint(1, 4))))
        yield " ".join(words) + rng.choice([".", ",", "!", "?", ""])


def build_tokenizer(vocab_size: int, seed: int = 0) -> Tokenizer:
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if vocab_size < len(alphabet) + len(SPECIAL_TOKENS):
        raise ValueError(
            f"vocab_size {vocab_size} < {len(alphabet) + len(SPECIAL_TOKENS)} "
            "(256 byte tokens and the special tokens)"
        )
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=alphabet,
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(seed), trainer=trainer)
    short = vocab_size - tok.get_vocab_size()
    tok.add_special_tokens([f"<|reserved_{i}|>" for i in range(short)])
    assert tok.get_vocab_size() == vocab_size, (tok.get_vocab_size(), vocab_size)
    return tok


def write_tokenizer(out: Path, vocab_size: int, seed: int = 0) -> Path:
    """``tokenizer.json``, and beside it the ``tokenizer_config.json`` that lets
    ``transformers`` (and so vLLM) load it as a fast tokenizer without a hub."""
    path = out / "tokenizer.json"
    build_tokenizer(vocab_size, seed).save(str(path))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": SPECIAL_TOKENS[0],
        "model_max_length": 1 << 20,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=1) + "\n")
    return path
