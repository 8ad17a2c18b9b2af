"""The token-dataset readers ``deepnvme bench data`` compares, and the sample orders it times.

Every reader turns the same sample indices into the same ``[batch, seq_len + 1]`` int64
tensors and sums them (the checksum that shows the readers read the same tokens): deepnvme's
:meth:`~deepnvme.data.TokenDataset.batches`, a plain ``np.memmap`` of the .bin sliced per
sample, and megatron-core's ``IndexedDataset`` (mmap) read the way its GPT dataset does,
``get(document, offset, length)`` for each document piece of a sample, concatenated.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from ..data import TokenDataset

__all__ = ["DataReader", "DATA_READERS", "plain_files", "sample_orders"]


@dataclasses.dataclass(frozen=True)
class DataReader:
    """One reader: ``call`` says how it reads (shown in the output), ``module`` must import,
    ``read(ds, order, batch_size, prefetch)`` returns the checksum of every batch it made."""

    name: str
    call: str
    module: str
    read: Callable[[TokenDataset, list[int], int, int], int]


def _chunks(order: list[int], size: int) -> Iterator[list[int]]:
    it = iter(order)
    while chunk := list(itertools.islice(it, size)):
        yield chunk


def _read_deepnvme(ds: TokenDataset, order: list[int], batch_size: int, prefetch: int) -> int:
    return sum(int(b.sum()) for b in ds.batches(order, batch_size, prefetch=prefetch))


def _stack(rows: Iterable[Any]) -> int:
    import numpy
    return int(torch.from_numpy(numpy.stack(list(rows)).astype(numpy.int64)).sum())


def plain_files(ds: TokenDataset) -> tuple[str, str]:
    """The dataset's .bin and .idx, which the stock readers open as plain files."""
    if not isinstance(ds.bin_path, str) or not isinstance(ds.idx_path, str):
        raise ValueError(f"{ds!r} is striped over a volume: the stock readers read plain files only")
    return ds.bin_path, ds.idx_path


def _read_memmap(ds: TokenDataset, order: list[int], batch_size: int, prefetch: int) -> int:
    import numpy
    tokens = numpy.memmap(plain_files(ds)[0], dtype=numpy.dtype(ds.index.dtype.name), mode="r",
                          offset=ds.index.base, shape=(ds.total_tokens,))
    n, total = ds.seq_len, 0
    for chunk in _chunks(order, batch_size):
        total += _stack(tokens[i * n:i * n + n + 1] for i in chunk)
    del tokens
    return total


def _read_megatron(ds: TokenDataset, order: list[int], batch_size: int, prefetch: int) -> int:
    import numpy
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    mds = IndexedDataset(plain_files(ds)[0][:-4], mmap=True)
    starts = [0, *itertools.accumulate(ds.index.lengths.tolist())]  # first token of each sequence
    n, total = ds.seq_len, 0
    for chunk in _chunks(order, batch_size):
        rows = []
        for i in chunk:
            at, left = i * n, n + 1
            seq = bisect.bisect_right(starts, at) - 1
            pieces = []
            while left:
                take = min(left, starts[seq + 1] - at)
                if take:
                    pieces.append(mds.get(seq, offset=at - starts[seq], length=take))
                at, left, seq = at + take, left - take, seq + 1
            rows.append(numpy.concatenate(pieces))
        total += _stack(rows)
    del mds
    return total


DATA_READERS: dict[str, DataReader] = {r.name: r for r in (
    DataReader("deepnvme", "TokenDataset.batches (AioHandle.read_many, O_DIRECT)", "deepnvme.data",
               _read_deepnvme),
    DataReader("megatron-core", "IndexedDataset(mmap=True).get(doc, offset, length) per piece",
               "megatron.core.datasets.indexed_dataset", _read_megatron),
    DataReader("np.memmap", "numpy.memmap(.bin)[start:end] per sample", "numpy", _read_memmap),
)}


def sample_orders(count: int, *, shuffled: int, sequential: int, seed: int) -> dict[str, list[int]]:
    """``shuffled``: that many distinct samples in random order from the whole dataset;
    ``sequential``: that many consecutive samples from a random start."""
    g = torch.Generator().manual_seed(seed)
    shuffled_order = torch.randperm(count, generator=g)[:min(shuffled, count)].tolist()
    run = min(sequential, count)
    start = int(torch.randint(0, count - run + 1, (1,), generator=g))
    return {"shuffled": shuffled_order, "sequential": list(range(start, start + run))}
