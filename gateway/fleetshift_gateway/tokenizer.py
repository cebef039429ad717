"""A served model's own tokenizer, its context length, and incremental detokenizing.

The gateway counts prompt tokens with the tokenizer the model's directory ships
(``tokenizer.json``, written by ``make_model`` for the reference models) and reads the context
length from its ``config.json``, so a prompt over the context is refused before anything is
routed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from tokenizers import Tokenizer

# A chat is flattened into one prompt with role tags (the reference tokenizer's special
# tokens); the assistant's turn is left open for the model to continue.
ROLES = ("system", "user", "assistant")
_HOLD_MAX = 4  # a byte-level token run this long that still decodes to U+FFFD is emitted anyway


@dataclass(frozen=True)
class ModelTokenizer:
    name: str
    tokenizer: Tokenizer
    context_tokens: int

    @cached_property
    def vocab_size(self) -> int:
        """Asked once: the library rebuilds its vocabulary to count it (~0.1 ms a request)."""
        return int(self.tokenizer.get_vocab_size())

    @classmethod
    def load(cls, name: str, model_dir: Path) -> ModelTokenizer:
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"model {name!r}: no tokenizer.json in {model_dir}")
        config = json.loads((model_dir / "config.json").read_text())
        return cls(name, Tokenizer.from_file(str(path)), int(config["max_position_embeddings"]))

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=False))

    def chat_prompt(self, messages: list[tuple[str, str]]) -> list[int]:
        text = "".join(f"<|{role}|>\n{content}\n" for role, content in messages)
        return self.encode(text + "<|assistant|>\n")

    def stream_decoder(self) -> StreamDecoder:
        return StreamDecoder(self)

    @cached_property
    def single_texts(self) -> dict[int, str]:
        """Each token's text on its own, decoded once (a decode call costs ~10 us per
        streamed token otherwise); bounded by the vocabulary."""
        return {}


class StreamDecoder:
    """Turns tokens into text one token at a time without splitting a UTF-8 character.

    A byte-level token can end inside a multi-byte character; its text is held (an empty
    delta) until the character completes, so the concatenated deltas equal decoding the whole
    sequence and every token still yields exactly one delta.
    """

    def __init__(self, tokenizer: ModelTokenizer) -> None:
        self._tokenizer = tokenizer
        self._texts = tokenizer.single_texts
        self._pending: list[int] = []

    def push(self, token: int) -> str:
        if not self._pending:  # the common case: one token, one whole character or more
            text = self._texts.get(token)
            if text is not None:
                return text
        self._pending.append(token)
        text = self._tokenizer.decode(self._pending)
        if len(self._pending) == 1 and not text.endswith("\ufffd"):
            self._texts[token] = text
        if text.endswith("\ufffd") and len(self._pending) < _HOLD_MAX:
            return ""
        self._pending = []
        return text

    def flush(self) -> str:
        text = self._tokenizer.decode(self._pending) if self._pending else ""
        self._pending = []
        return text
