"""Offline text data for the GPT-2 example.

The corpus is the Python standard library's source installed on this machine: a few MB
of real English docstrings and code, the same on every machine with the same Python. A
byte-level BPE is trained on it at first use (a few seconds) and cached, with the token
ids, under the output directory. Nothing is downloaded.
"""

from __future__ import annotations

import fcntl
import json
import sysconfig
from contextlib import contextmanager
from pathlib import Path

import torch
from torch.utils.data import Dataset

END_OF_TEXT = "<|endoftext|>"


def corpus_files(limit_bytes: int) -> list[Path]:
    """Standard-library modules (tests left out), in a fixed order, up to about `limit_bytes`."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chosen, total = [], 0
    for path in sorted(root.rglob("*.py")):
        parts = set(path.relative_to(root).parts)
        if parts & {"test", "tests", "site-packages", "idlelib", "lib2to3"}:
            continue
        chosen.append(path)
        total += path.stat().st_size
        if total >= limit_bytes:
            break
    return chosen


@contextmanager
def _locked(directory: Path):
    """Ranks (and concurrent experiments) build the cache once; the others wait and reuse it."""
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / ".lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def load_tokens(cache_dir: Path, vocab_size: int, corpus_mb: float) -> tuple[torch.Tensor, int]:
    """Token ids of the whole corpus and the tokenizer's vocabulary size, built once and cached."""
    from tokenizers import ByteLevelBPETokenizer, Tokenizer

    key = f"stdlib_{corpus_mb:g}mb_bpe{vocab_size}"
    directory = cache_dir / key
    tokens_path, tokenizer_path = directory / "tokens.pt", directory / "tokenizer.json"
    with _locked(directory):
        if not tokens_path.exists():
            texts = [p.read_text(encoding="utf-8", errors="ignore") for p in corpus_files(int(corpus_mb * 2**20))]
            bpe = ByteLevelBPETokenizer()
            bpe.train_from_iterator(texts, vocab_size=vocab_size, min_frequency=2, special_tokens=[END_OF_TEXT])
            bpe.save(str(tokenizer_path))
            end = bpe.token_to_id(END_OF_TEXT)
            ids: list[int] = []
            for encoding in bpe.encode_batch(texts):
                ids.extend(encoding.ids)
                ids.append(end)
            torch.save(torch.tensor(ids, dtype=torch.int32), tokens_path)
            (directory / "info.json").write_text(json.dumps({"files": len(texts), "tokens": len(ids)}))
    tokens = torch.load(tokens_path, weights_only=True)
    return tokens.long(), Tokenizer.from_file(str(tokenizer_path)).get_vocab_size()


class TokenBlocks(Dataset):
    """Consecutive blocks of `block_size` tokens; the model shifts labels itself."""

    def __init__(self, tokens: torch.Tensor, block_size: int):
        self.tokens = tokens
        self.block_size = block_size

    def __len__(self) -> int:
        return len(self.tokens) // self.block_size

    def __getitem__(self, index: int) -> torch.Tensor:
        start = index * self.block_size
        return self.tokens[start:start + self.block_size]
