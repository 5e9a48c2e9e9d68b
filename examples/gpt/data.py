"""Deterministic token data that needs no download, and its position in the stream.

Sample ``i`` of a dataset is a pure function of ``i`` (and the seed), so the only data
state a checkpoint needs is ``consumed_samples``: a resumed run reads exactly the
samples the uninterrupted run would have read.
"""

from __future__ import annotations

from typing import Iterator, Tuple

import torch

__all__ = ["ByteTextDataset", "SyntheticDataset", "build_dataset", "micro_batches"]


class SyntheticDataset:
    """Arithmetic token sequences: a random start and stride per sample, modulo the vocabulary.

    Learnable (each token is the previous plus the stride), so the loss visibly falls.
    """

    def __init__(self, vocab_size: int, seq_length: int, seed: int):
        self.vocab_size = vocab_size
        self.seq_length = seq_length
        self.seed = seed

    def __getitem__(self, index: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        start, stride = torch.randint(0, self.vocab_size, (2,), generator=generator).tolist()
        steps = torch.arange(self.seq_length + 1, dtype=torch.long)
        return (start + (stride % 7 + 1) * steps) % self.vocab_size


class ByteTextDataset:
    """Windows of ``seq_length + 1`` bytes of a text file, with a fixed stride through it."""

    def __init__(self, path: str, seq_length: int):
        with open(path, "rb") as f:
            data = f.read()
        if len(data) < seq_length + 2:
            raise SystemExit(f"{path} has {len(data)} bytes; it needs at least "
                             f"--seq-length + 2 = {seq_length + 2}")
        self.tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
        self.seq_length = seq_length
        self._num_starts = len(data) - seq_length
        # Half a window apart: consecutive samples share half their bytes and a small
        # file is covered in few samples.
        self._stride = max(1, seq_length // 2 + 1)

    def __getitem__(self, index: int) -> torch.Tensor:
        start = (index * self._stride) % self._num_starts
        return self.tokens[start : start + self.seq_length + 1]


def build_dataset(args):
    """Return the byte-level text dataset for ``--data-path``, else the synthetic one."""
    if args.data_path:
        return ByteTextDataset(args.data_path, args.seq_length)
    return SyntheticDataset(args.vocab_size, args.seq_length, args.seed)


def micro_batches(
    dataset,
    consumed_samples: int,
    global_batch_size: int,
    micro_batch_size: int,
    dp_rank: int,
    dp_size: int,
) -> Iterator[Tuple[torch.Tensor, torch.Tensor]]:
    """Yield this data-parallel rank's ``(tokens, labels)`` micro batches of one global batch.

    Runs on every rank. The global batch is samples ``consumed_samples ...
    consumed_samples + global_batch_size - 1``; data-parallel rank ``r`` takes the
    ``r``-th contiguous slice and splits it into micro batches. Tensor-parallel peers
    (same data-parallel rank) get the same tokens.
    """
    per_rank = global_batch_size // dp_size
    first = consumed_samples + dp_rank * per_rank
    for offset in range(0, per_rank, micro_batch_size):
        samples = torch.stack([dataset[first + offset + i] for i in range(micro_batch_size)])
        yield samples[:, :-1].contiguous(), samples[:, 1:].contiguous()
