"""Object storage against local disk, side by side, on a real S3 server started here (SeaweedFS's ``weed``, the
``[s3]`` extra; ``tests/s3_server.py``).

``--part clients`` (which client the store uses): write and range-read throughput of a store's objects through each
candidate client (obstore, multi-storage-client, s3fs), as ratios to local disk: shard objects of ``--object-mib``
written one at a time (what one writer rank does), then ``--reads`` chunk-sized ranges (``--range-kib``, a sample's
chunk at S=512, K=100) read one at a time and ``--batch`` at a time (batched / concurrent requests).

``--part store`` (issue #38 goal 5): the same store written by the cache writer to a local folder and to
``s3://``, write tokens/s of each, then one data-parallel rank's training read (``cache.KDRows`` over the store at
S=512, every row checked) in tokens/s, local and S3.

    python tools/bench_object_store.py [--part clients|store|both]

Prints one table per part; run nothing else heavy beside it (the server shares the CPUs).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import pathlib
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from tests.s3_server import LocalS3  # noqa: E402


def _timed(fn) -> float:
    begin = time.perf_counter()
    fn()
    return time.perf_counter() - begin


class LocalClient:
    name = "local disk"

    def __init__(self, root: pathlib.Path):
        self.root = root

    def put(self, key: str, data: bytes) -> None:
        path = self.root / key
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_name(path.name + ".partial")
        temporary.write_bytes(data)
        os.replace(temporary, path)

    def ranges(self, key: str, spans: list[tuple[int, int]]) -> list[bytes]:
        fd = os.open(self.root / key, os.O_RDONLY)
        try:
            return [os.pread(fd, length, start) for start, length in spans]
        finally:
            os.close(fd)


class ObstoreClient:
    name = "obstore"

    def __init__(self, url: str):
        from obstore.store import from_url

        self.store = from_url(url, client_options={"allow_http": True})

    def put(self, key, data):
        import obstore

        obstore.put(self.store, key, data)

    def ranges(self, key, spans):
        import obstore

        return [bytes(b) for b in obstore.get_ranges(self.store, key, starts=[s for s, _ in spans],
                                                     lengths=[n for _, n in spans])]


class MSCClient:
    name = "multi-storage-client"

    def __init__(self, url: str, pool: concurrent.futures.ThreadPoolExecutor):
        import multistorageclient as msc

        self.client, self.base = msc.resolve_storage_client(url)
        self.pool = pool

    def put(self, key, data):
        self.client.write(f"{self.base}/{key}", data)

    def ranges(self, key, spans):
        from multistorageclient.types import Range

        read = lambda span: self.client.read(f"{self.base}/{key}", byte_range=Range(offset=span[0], size=span[1]))
        return list(self.pool.map(read, spans)) if len(spans) > 1 else [read(spans[0])]


class S3fsClient:
    name = "s3fs"

    def __init__(self, url: str):
        import s3fs

        self.fs = s3fs.S3FileSystem(endpoint_url=os.environ["AWS_ENDPOINT_URL"])
        self.base = url.removeprefix("s3://")

    def put(self, key, data):
        self.fs.pipe_file(f"{self.base}/{key}", data)

    def ranges(self, key, spans):
        path = f"{self.base}/{key}"
        return self.fs.cat_ranges([path] * len(spans), [s for s, _ in spans], [s + n for s, n in spans])


def bench_clients(server: LocalS3, folder: pathlib.Path, args) -> None:
    rng = np.random.default_rng(0)
    size, objects = args.object_mib << 20, args.objects
    payloads = [rng.integers(0, 256, size, dtype=np.uint8).tobytes() for _ in range(objects)]
    span = args.range_kib << 10
    reads = [(int(rng.integers(objects)), int(rng.integers(0, size - span))) for _ in range(args.reads)]
    pool = concurrent.futures.ThreadPoolExecutor(args.batch)
    clients = [LocalClient(folder / "local")]
    for make in (lambda: ObstoreClient("s3://bench/clients/obstore"),
                 lambda: MSCClient("msc://local/bench/clients/msc", pool), lambda: S3fsClient("s3://bench/clients/s3fs")):
        try:
            clients.append(make())
        except ImportError as exc:                        # the [s3] extra has obstore and MSC; s3fs, boto3 are extra
            print(f"skipped a client: {exc} (pip install s3fs boto3 for every column)")
    rows = []
    for client in clients:
        write = _timed(lambda: [client.put(f"shard/{i}", payload) for i, payload in enumerate(payloads)])
        one = _timed(lambda: [client.ranges(f"shard/{o}", [(s, span)]) for o, s in reads])
        by_object: dict[int, list] = {}
        for o, s in reads:
            by_object.setdefault(o, []).append((s, span))
        batched = _timed(lambda: [client.ranges(f"shard/{o}", spans[i:i + args.batch])
                                  for o, spans in by_object.items() for i in range(0, len(spans), args.batch)])
        mib = objects * size / 2**20, len(reads) * span / 2**20
        rows.append((client.name, mib[0] / write, mib[1] / one, mib[1] / batched))
    pool.shutdown()
    base = rows[0]
    print(f"\nclients: {objects} objects of {args.object_mib} MiB written one at a time; {len(reads)} ranges of "
          f"{args.range_kib} KiB read one at a time and {args.batch} at a time (MiB/s; x local disk)")
    print(f"| client | write MiB/s | x local | range read MiB/s | x local | batched read MiB/s | x local |")
    print("|---|---|---|---|---|---|---|")
    for name, write, one, batched in rows:
        print(f"| {name} | {write:.0f} | {write / base[1]:.2f} | {one:.0f} | {one / base[2]:.2f} | {batched:.0f} | "
              f"{batched / base[3]:.2f} |")


def bench_store(folder: pathlib.Path, args) -> None:
    import torch

    from megatron_kd_plugin.cache import KDRows, TopKCacheReader, row_kind
    from megatron_kd_plugin.cache.sources.token_windows import TokenWindows
    from megatron_kd_plugin.cache.writer import write_cache

    vocab, seq, k = 4096, 512, 100
    table = 4 * torch.randn(1024, vocab, generator=torch.Generator().manual_seed(0))
    logits_fn = lambda tokens, position_ids=None: table[tokens % 1024].transpose(0, 1)          # [s, b, V], cheap and deterministic
    stream = np.random.default_rng(1).integers(0, vocab, args.samples * seq + 1)
    places = {"local disk": str(folder / "store.zarr"), "s3://": "s3://bench/store/topk"}
    rows = {}
    for name, output in places.items():
        source = TokenWindows(stream, seq, num_samples=args.samples, fingerprint="bench", tokenizer="bench",
                              tokenizer_vocab_size=vocab)
        stats = write_cache(source, logits_fn, output, k=k, vocab_size=vocab, teacher="bench",
                            samples_per_shard=args.samples // 16, micro_batch_size=4, progress=False)
        reader = TopKCacheReader(output)
        dataset = KDRows(row_kind(reader, seq_length=seq), range(len(reader)), num_rows=2 * len(reader), seed=0)
        begin = time.perf_counter()
        for row in range(len(dataset)):
            dataset[row]
        read = time.perf_counter() - begin
        rows[name] = (stats.tokens / stats.total_seconds, len(dataset) * seq / read)
    base = rows["local disk"]
    print(f"\nstore: {args.samples} samples x S={seq}, K={k}, V={vocab} (grid8), shards of {args.samples // 16} "
          "samples; write = the cache writer's shard loop (a table teacher: top-K, codecs, PUTs), read = one DP "
          "rank's KDRows over two epochs (shuffled rows, every chunk checked, read-ahead on S3)")
    print("| store | write tokens/s | x local | read tokens/s | x local |")
    print("|---|---|---|---|---|")
    for name, (write, read) in rows.items():
        print(f"| {name} | {write:,.0f} | {write / base[0]:.2f} | {read:,.0f} | {read / base[1]:.2f} |")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=("clients", "store", "both"), default="both")
    parser.add_argument("--objects", type=int, default=8)
    parser.add_argument("--object-mib", type=int, default=8)
    parser.add_argument("--range-kib", type=int, default=100)
    parser.add_argument("--reads", type=int, default=400)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--samples", type=int, default=1024, help="store part: samples of S=512 tokens")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench_object_store.") as tmp:
        folder = pathlib.Path(tmp)
        server = LocalS3.start(folder / "s3")
        try:
            os.environ.update(server.env())
            os.environ["MSC_CONFIG"] = str(server.msc_config(folder / "msc.json"))
            server.create_bucket("bench")
            print(f"load average before: {os.getloadavg()[0]:.2f} (cores: {os.cpu_count()})")
            if args.part in ("clients", "both"):
                bench_clients(server, folder, args)
            if args.part in ("store", "both"):
                bench_store(folder, args)
            print(f"load average after: {os.getloadavg()[0]:.2f}")
        finally:
            server.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
