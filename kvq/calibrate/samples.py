"""Turn documents into calibration samples: fixed-length token windows, chosen by a seed, fingerprinted.

Documents are tokenized without special tokens and joined with EOS into one stream; the stream is cut
into non-overlapping windows of `seq_len` tokens (BOS first when the tokenizer has one) and
`num_samples` windows are drawn with `torch.randperm` seeded by `seed`. The fingerprint is the sha256
of the chosen token ids, so two runs on the same samples carry the same fingerprint.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch
from transformers import PreTrainedTokenizerBase

from kvq.errors import KvqError


@dataclass(frozen=True)
class CalibrationSamples:
    """The token samples of one run and where they came from."""

    input_ids: torch.Tensor  # [num_samples, seq_len] int64
    source: str
    num_texts: int
    num_stream_tokens: int

    @property
    def fingerprint(self) -> str:
        return token_fingerprint(self.input_ids)


def token_fingerprint(input_ids: torch.Tensor) -> str:
    """sha256 of int64 token ids in row-major order (little-endian), as hex."""
    data = input_ids.to(torch.int64).contiguous().numpy().astype("<i8").tobytes()
    return hashlib.sha256(data).hexdigest()


def build_samples(
    texts: list[str],
    tokenizer: PreTrainedTokenizerBase,
    *,
    num_samples: int,
    seq_len: int,
    seed: int,
    source: str,
) -> CalibrationSamples:
    """`num_samples` windows of `seq_len` tokens from `texts`; `KvqError` if the text is too short."""
    stream = token_stream(texts, tokenizer)
    bos = tokenizer.bos_token_id
    body_len = seq_len - (bos is not None)
    num_windows = len(stream) // body_len
    if num_windows < num_samples:
        raise KvqError(
            f"{source}: {len(texts)} document(s) give {len(stream)} tokens, enough for {num_windows} "
            f"sample(s) of {seq_len} tokens but {num_samples} were asked for; lower --num-samples or "
            f"--seq-len, or give more text with --dataset"
        )
    generator = torch.Generator().manual_seed(seed)
    chosen = torch.randperm(num_windows, generator=generator)[:num_samples].sort().values
    windows = stream[: num_windows * body_len].view(num_windows, body_len)
    input_ids = windows[chosen]  # [num_samples, body_len]
    if bos is not None:
        input_ids = torch.cat([torch.full((num_samples, 1), bos, dtype=torch.int64), input_ids], dim=1)
    return CalibrationSamples(input_ids.contiguous(), source, len(texts), len(stream))


def token_stream(texts: list[str], tokenizer: PreTrainedTokenizerBase) -> torch.Tensor:
    """All documents as one int64 tensor of token ids, EOS between documents (when the tokenizer has one).

    Encoded one document at a time: a corpus as Python int lists would cost ~40 bytes per token.
    """
    eos = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
    parts = []
    for i, text in enumerate(texts):
        ids = tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]
        parts.append(torch.tensor((eos if i else []) + ids, dtype=torch.int64))
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)
