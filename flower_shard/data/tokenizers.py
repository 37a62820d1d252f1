"""Tokenizers: UTF-8 bytes by default, or a local Hugging Face tokenizer (never from a hub)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from flower_shard.config import ConfigError


class ByteTokenizer:
    """UTF-8 bytes as tokens 0..255, plus 256 as end-of-document."""

    name = "bytes"
    vocab_size = 257
    eos_id = 256

    def encode(self, data: bytes) -> np.ndarray:
        return np.frombuffer(data, dtype=np.uint8).astype(np.uint16)

    def encode_batch(self, texts: list[bytes]) -> list[np.ndarray]:
        return [self.encode(t) for t in texts]


class HFTokenizer:
    """A Hugging Face tokenizer loaded from a local directory (never from a hub)."""

    def __init__(self, path: str):
        from transformers import AutoTokenizer

        try:
            self._tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
        except Exception as exc:  # transformers raises many types for a bad directory
            raise ConfigError(
                f"--tokenizer {path}: not a loadable tokenizer directory ({type(exc).__name__}); "
                "it needs tokenizer.json or the files of a saved tokenizer"
            ) from exc
        self.name = f"hf:{Path(path).resolve()}"
        self.vocab_size = len(self._tok)
        eos = self._tok.eos_token_id
        self.eos_id = eos if eos is not None else self.vocab_size - 1

    def encode(self, data: bytes) -> np.ndarray:
        return self.encode_batch([data])[0]

    def encode_batch(self, texts: list[bytes]) -> list[np.ndarray]:
        """The ids of each text (UTF-8; invalid bytes replaced), in one call of the fast
        tokenizer (the same ids as one call per text: no padding, no truncation)."""
        decoded = [t.decode("utf-8", errors="replace") for t in texts]
        ids = self._tok(decoded, add_special_tokens=False, verbose=False)["input_ids"]
        return [np.asarray(i, dtype=np.uint32) for i in ids]


def load_tokenizer(path: str | None):
    """The byte tokenizer (``path`` None) or the Hugging Face tokenizer in directory ``path``."""
    return ByteTokenizer() if path is None else HFTokenizer(path)
