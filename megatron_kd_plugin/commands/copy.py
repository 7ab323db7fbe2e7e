"""``python -m megatron_kd_plugin copy SOURCE DESTINATION [--workers N]``: copies a complete store between a local
folder, ``s3://BUCKET/PREFIX`` and ``msc://PROFILE/PATH`` so that it stays valid (``cache/store/store_copy.py``): its
files first (each streamed in bounded pieces: memory stays flat whatever the file sizes), the root zarr.json last,
then every chunk of the copy read back and checked. A copy killed midway is refused by readers until the same
command finishes it, copying only the files it had not finished (a file already there of the source's size and
CRC32C is kept).
"""

from __future__ import annotations

import argparse
import os

from megatron_kd_plugin.cache.store.store_copy import copy_store


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m megatron_kd_plugin copy", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source", help="a complete store: a folder, s3://BUCKET/PREFIX or msc://PROFILE/PATH")
    parser.add_argument("destination", help="an empty place (or an interrupted copy of the same store)")
    parser.add_argument("--workers", type=int, default=16, help="files copied at once (default 16)")
    parser.add_argument("--verify-workers", type=int, default=os.cpu_count() or 1,
                        help="processes that check the copy (default: one per core)")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    try:
        stats = copy_store(args.source, args.destination, workers=args.workers, verify_workers=args.verify_workers,
                            progress=not args.no_progress)
    except (ValueError, OSError) as exc:
        print(f"error: {exc}")
        return 2
    kept = f"; {stats.files_kept} files ({stats.bytes_kept} bytes) already there and kept" if stats.files_kept else ""
    print(f"copied {args.source} to {args.destination} ({stats.files_copied} files, {stats.bytes_copied} bytes"
          f"{kept}); every chunk of the copy verified")
    return 0
