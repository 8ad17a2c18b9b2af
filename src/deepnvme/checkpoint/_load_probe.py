"""One timed whole-file load in a fresh process, for ``deepnvme tune --load``
(:func:`._load_path.measure_whole`): ``python -m deepnvme.checkpoint._load_probe FILE KIND COUNT NUMEL``.

FILE is a safetensors file of COUNT uint8 tensors ``t0``... of NUMEL bytes each; KIND is
``fresh_direct``, ``fresh_mapped``, ``into_direct`` or ``into_mapped``. A fresh load is
``deepnvme.load_safetensors`` on that path, timed until one byte of every page has been read
(what a caller pays on first use of the tensors); ``load_into`` fills tensors allocated and
touched before the clock starts. Prints ``{"kind": ..., "seconds": ..., "bytes": ...}`` as the
last line of standard output. A fresh process for each load, so that nothing of the previous
load (memory it faulted in and freed, the allocator's pools) speeds up or slows down the next,
as whole loads of a job would run.
"""

from __future__ import annotations

import json
import sys
import time

import torch

KINDS = ("fresh_direct", "fresh_mapped", "into_direct", "into_mapped")


def run(path: str, kind: str, count: int, numel: int) -> float:
    """Seconds of one ``kind`` load of ``path`` in this process (see the module)."""
    import deepnvme
    from deepnvme.io.posix import evict_page_cache

    if kind not in KINDS:
        raise ValueError(f"load probe: unknown kind {kind!r}; one of {', '.join(KINDS)}")
    config = {"load_path": kind.split("_")[1]}
    target = {f"t{i}": torch.ones(numel, dtype=torch.uint8) for i in range(count)} if kind.startswith("into") else {}
    evict_page_cache(path)
    t0 = time.perf_counter()
    if target:
        deepnvme.load_into(target, path, config=config)
    else:
        loaded = deepnvme.load_safetensors(path, config=config)
        if len(loaded) != count:
            raise ValueError(f"load probe: {path!r} holds {len(loaded)} tensors, expected {count}")
        for tensor in loaded.values():
            int(tensor.reshape(-1).view(torch.uint8)[::4096].sum())  # the first access of every page
    return time.perf_counter() - t0


def main(argv: list[str]) -> int:
    path, kind, count, numel = argv[0], argv[1], int(argv[2]), int(argv[3])
    seconds = run(path, kind, count, numel)
    print(json.dumps({"kind": kind, "seconds": seconds, "bytes": count * numel}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
