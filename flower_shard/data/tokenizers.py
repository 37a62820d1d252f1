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
        ids = self._tok(data.decode("utf-8", errors="replace"), add_special_tokens=False)
        return np.asarray(ids["input_ids"], dtype=np.uint32)


def load_tokenizer(path: str | None):
    return ByteTokenizer() if path is None else HFTokenizer(path)
