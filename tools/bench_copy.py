"""Peak memory and throughput of ``copy``'s file moves, the old way (each file read whole, written whole) against the
streamed one (``store_copy.copy_files``: pieces and multipart parts), local disk -> S3 -> local disk, on a real S3
server started here (SeaweedFS's ``weed``, ``tests/s3_server.py``), with the command's default ``--workers``.

The files are a store's layout filled with random bytes (``--files`` shard files ``teacher_ids/c.N.0.0`` of
``--file-mib`` each, a default shard's ids file is ~400 MB, plus their zarr.json files): making a real store of
such shards takes a teacher's forward over millions of tokens, and the copy moves bytes, whatever they hold. Each
copy runs in a fresh process that first imports what the ``copy`` command imports; it reports its peak RSS (the
whole process's high-water mark, ``VmHWM``: ``ru_maxrss`` would carry this script's own peak over into the child, it
survives exec), its peak once those modules are imported, the rise between them (what the copy itself held) and
whether torch was among the imports.

    python tools/bench_copy.py [--files 8] [--file-mib 400] [--workers 16] [--folder /tmp]

Needs about 3 x files x file-mib of disk under ``--folder`` (removed afterwards); run nothing heavy beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from tests.s3_server import LocalS3  # noqa: E402

WAYS = ("whole files", "streamed")


def make_files(folder: pathlib.Path, files: int, file_mib: int) -> None:
    """``files`` random shard files of ``file_mib`` MiB and the zarr.json files of a store's layout under ``folder``,
    written 64 MiB at a time."""
    import numpy as np

    rng = np.random.default_rng(0)
    (folder / "teacher_ids").mkdir(parents=True)
    for name in ("zarr.json", "teacher_ids/zarr.json"):
        (folder / name).write_text(json.dumps({"zarr_format": 3, "node_type": "group"}))
    for shard in range(files):
        with open(folder / f"teacher_ids/c.{shard}.0.0", "wb") as file:
            for begin in range(0, file_mib, 64):
                file.write(rng.bytes(min(64, file_mib - begin) << 20))


def peak_rss_mib() -> float:
    """This process's peak resident set so far (Linux's ``VmHWM``, in MiB)."""
    for line in pathlib.Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status (Linux only)")


def copy_in_this_process(way: str, source: str, destination: str, workers: int) -> dict:
    """Copies every file of ``source`` to ``destination`` the ``way`` named; {seconds, bytes, peak and start RSS}."""
    import concurrent.futures

    import megatron_kd_plugin.commands.copy  # noqa: F401 (what the command imports)
    from megatron_kd_plugin.cache.store.storage import location
    from megatron_kd_plugin.cache.store.store_copy import copy_files

    start_mib = peak_rss_mib()
    origin, target = location(source), location(destination)
    sizes = origin.sizes()
    begin = time.perf_counter()
    if way == WAYS[0]:                                    # the copy as it was: get whole, put whole
        with concurrent.futures.ThreadPoolExecutor(workers) as pool:
            list(pool.map(lambda key: target.put(key, origin.get(key)), sizes))
    else:
        copy_files(origin, target, sizes, workers=workers)
    seconds = time.perf_counter() - begin
    return {"seconds": seconds, "bytes": sum(sizes.values()), "peak_mib": peak_rss_mib(), "start_mib": start_mib,
            "torch": "torch" in sys.modules}


def copy_in_a_process(way: str, source: str, destination: str, workers: int) -> dict:
    done = subprocess.run([sys.executable, __file__, "--child", way, source, destination, "--workers", str(workers)],
                          capture_output=True, text=True, check=True)
    return json.loads(done.stdout.splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--files", type=int, default=8)
    parser.add_argument("--file-mib", type=int, default=400)
    parser.add_argument("--workers", type=int, default=16, help="the copy command's default")
    parser.add_argument("--folder", default=tempfile.gettempdir())
    parser.add_argument("--child", nargs=3, metavar=("WAY", "SOURCE", "DESTINATION"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(copy_in_this_process(*args.child, args.workers)))
        return
    root = pathlib.Path(tempfile.mkdtemp(prefix="bench_copy_", dir=args.folder))
    server = LocalS3.start(root / "s3")
    try:
        os.environ.update(server.env())
        server.create_bucket("bench")
        make_files(root / "source", args.files, args.file_mib)
        print(f"{args.files} files of {args.file_mib} MiB, --workers {args.workers}\n")
        print("| way | direction | MB/s | peak RSS MiB | RSS after imports MiB | rise MiB | torch imported |\n"
              "|---|---|---|---|---|---|---|")
        for number, way in enumerate(WAYS):
            url, back = f"s3://bench/copy{number}", str(root / f"back{number}")
            for direction, source, destination in (("local -> S3", str(root / "source"), url),
                                                   ("S3 -> local", url, back)):
                found = copy_in_a_process(way, source, destination, args.workers)
                print(f"| {way} | {direction} | {found['bytes'] / found['seconds'] / 1e6:.0f} | "
                      f"{found['peak_mib']:.0f} | {found['start_mib']:.0f} | "
                      f"{found['peak_mib'] - found['start_mib']:.0f} | {'yes' if found['torch'] else 'no'} |",
                      flush=True)
            shutil.rmtree(back)
    finally:
        server.stop()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
