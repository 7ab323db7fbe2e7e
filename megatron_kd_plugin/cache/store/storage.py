"""Where a store's files live: a local folder (:class:`LocalFolder`) or a prefix of an object store
(:class:`ObjectPrefix`: ``s3://bucket/prefix``, or ``msc://profile/path`` through a multi-storage-client profile),
behind one small interface: whole objects, the tail of one (a shard's index) and byte ranges of one (its chunks),
a file streamed in bounded pieces either way (``read_pieces`` / ``write_pieces``: what ``copy`` moves files with),
conditional writes, listing and deletion, and the zarr store of the location.

The object-store client is obstore (zarr 3's ``ObjectStore`` wraps it), chosen by ``tools/bench_object_store.py``
against multi-storage-client and s3fs on a real S3 server (docs/object-storage.md: it read a store's
chunk ranges 3-5x faster, batched, and wrote as fast). Credentials and endpoints are the client's users' own:
``s3://`` reads the ``AWS_*`` variables (``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``...) and ``~/.aws`` profiles
(``AWS_PROFILE``) like every S3 client; ``msc://PROFILE/...`` reads the profile of multi-storage-client's own config
(``MSC_CONFIG`` or its default paths), whose S3 ``storage_provider`` (endpoint, region, ``base_path``) and
``credentials_provider`` it connects to. Nothing of them is stored in a store or printed.

Every failure of the client becomes one line naming the URL: a missing bucket, refused credentials, an endpoint
that does not answer.
"""

from __future__ import annotations

import collections
import configparser
import contextlib
import os
import pathlib
import re
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]+):/")
"""A URL's scheme (``s3://``, ``msc://``, ``gs://``...), also as ``pathlib`` folds it (``s3:/bucket``)."""
SCHEMES = ("s3", "msc")
"""The object-store URL schemes a store (and token data) may live under."""
COALESCE = 1 << 16
"""Ranges of one object less than this many bytes apart are fetched in one request (obstore's default, 1 MiB, would
fetch up to a MiB of unwanted bytes between two random samples' chunks)."""
PIECE_BYTES = 1 << 20
"""The bytes :meth:`read_pieces` reads at a time (one ``read`` of a file, or of an object's response body)."""
MIN_PART_BYTES = 5 << 20
"""S3's smallest part of a multipart upload (all but the last part; SeaweedFS enforces it too): the default
``part_bytes`` of :meth:`ObjectPrefix.write_pieces`. 10,000 parts at most: objects up to 48 GiB at this size."""
UPLOAD_CONCURRENCY = 1
"""Parts of one multipart upload sent at once, beside the one being filled: an upload holds at most
``(UPLOAD_CONCURRENCY + 1) * part_bytes`` (the copy gets its parallelism from several files at once)."""


def location(path, what: str = "a store") -> "LocalFolder | ObjectPrefix":
    """``path`` as a :class:`LocalFolder` or an :class:`ObjectPrefix`; ValueError (one line) for a URL of another
    scheme (``pathlib`` would fold ``gs://bucket/x`` into a local folder named ``gs:``)."""
    if isinstance(path, (LocalFolder, ObjectPrefix)):
        return path
    text = os.fspath(path)
    url = _URL.match(text)
    if url is None:
        return LocalFolder(pathlib.Path(path))
    scheme = url.group(1).lower()
    if scheme not in SCHEMES:
        raise ValueError(f"{text}: {what} on {scheme}:// is not supported (object storage: s3:// and msc:// only); "
                         "copy it to s3://, or to a local or mounted file system, and pass that path")
    prefix = ObjectPrefix.from_url(re.sub(r"^([A-Za-z0-9+.-]+):/+", lambda m: m.group(1).lower() + "://", text))
    if not prefix.prefix:
        raise ValueError(f"{text}: {what} at a bucket's root is not supported; name a prefix inside it "
                         "(s3://BUCKET/PREFIX, msc://PROFILE/PATH)")
    return prefix


def is_object_url(path) -> bool:
    """Whether ``path`` names an object-store location (a URL of one of :data:`SCHEMES`)."""
    url = _URL.match(os.fspath(path)) if not isinstance(path, (LocalFolder, ObjectPrefix)) else None
    return isinstance(path, ObjectPrefix) or (url is not None and url.group(1).lower() in SCHEMES)


@dataclass(frozen=True)
class LocalFolder:
    """A store in the local (or mounted) folder ``path``."""

    path: pathlib.Path

    def __str__(self) -> str:
        return str(self.path)

    def name(self, key: str) -> str:
        return str(self.path / key)

    def tail(self, key: str, nbytes: int) -> tuple[bytes, int]:
        """(the last ``nbytes`` bytes of ``key`` (all of it when shorter), its size); FileNotFoundError."""
        fd = os.open(self.path / key, os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            return os.pread(fd, min(nbytes, size), max(0, size - nbytes)), size
        finally:
            os.close(fd)

    def ranges(self, key: str, spans: list[tuple[int, int]]) -> list[bytes]:
        """The bytes of each (offset, length) of ``key``; FileNotFoundError."""
        fd = os.open(self.path / key, os.O_RDONLY)
        try:
            return [os.pread(fd, int(length), int(offset)) for offset, length in spans]
        finally:
            os.close(fd)

    def get(self, key: str) -> bytes:
        return (self.path / key).read_bytes()

    def read_pieces(self, key: str, piece_bytes: int = PIECE_BYTES) -> Iterator[bytes]:
        """``key``'s bytes, ``piece_bytes`` at a time (the last piece shorter); FileNotFoundError."""
        with open(self.path / key, "rb", buffering=0) as file:
            while piece := file.read(piece_bytes):
                yield piece

    def exists(self, key: str) -> bool:
        return os.path.isfile(self.path / key)

    def keys(self, prefix: str = "") -> list[str]:
        """Every file under the folder (``prefix``: under that sub-path), as keys relative to it, sorted."""
        root = self.path / prefix if prefix else self.path
        return sorted(str(file.relative_to(self.path)) for file in root.rglob("*") if file.is_file()) \
            if root.is_dir() else []

    def sizes(self) -> dict[str, int]:
        """{key: bytes} of every file under the folder."""
        return {key: os.path.getsize(self.path / key) for key in self.keys()}

    def put(self, key: str, data: bytes) -> None:
        """Writes ``key`` atomically (a temporary file renamed into place)."""
        self.write_pieces(key, [data])

    def write_pieces(self, key: str, pieces: Iterable[bytes], part_bytes: int | None = None) -> None:
        """Writes ``key`` from ``pieces`` as they come, atomically: into a temporary file (``NAME.<uuid>.partial``,
        deleted if ``pieces`` raises) renamed into place once complete. ``part_bytes``: unused (object storage's)."""
        path = self.path / key
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_name(f"{path.name}.{uuid.uuid4().hex}.partial")
        try:
            with open(temporary, "wb") as file:
                for piece in pieces:
                    file.write(piece)
            os.replace(temporary, path)
        finally:
            temporary.unlink(missing_ok=True)


class ObjectPrefix:
    """A store under the prefix ``url`` of an object store, through obstore (module docstring)."""

    def __init__(self, url: str, store, bucket: str, prefix: str):
        self.url, self.store, self.bucket, self.prefix = url.rstrip("/"), store, bucket, prefix.strip("/")

    def __str__(self) -> str:
        return self.url

    def __repr__(self) -> str:
        return f"ObjectPrefix({self.url!r})"

    def __eq__(self, other) -> bool:
        return isinstance(other, ObjectPrefix) and other.url == self.url

    def __hash__(self) -> int:
        return hash(self.url)

    @classmethod
    def from_url(cls, url: str) -> "ObjectPrefix":
        scheme, rest = url.split("://", 1)
        if scheme == "msc":
            profile, _, path = rest.partition("/")
            options, base = _msc_profile(url, profile)
            bucket, _, prefix = f"{base.strip('/')}/{path}".strip("/").partition("/")
        else:
            options = _aws_options()
            bucket, _, prefix = rest.partition("/")
        if not bucket:
            raise ValueError(f"{url}: no bucket named (s3://BUCKET/PREFIX, msc://PROFILE/PATH)")
        from obstore.store import S3Store

        endpoint = options.pop("endpoint", None)
        store = S3Store(bucket, prefix=prefix.strip("/"), **({"endpoint": endpoint} if endpoint else {}),
                        client_options={"allow_http": bool(endpoint and endpoint.startswith("http://")),
                                        "connect_timeout": "5s", "timeout": "120s"},
                        retry_config={"max_retries": 3, "retry_timeout": _seconds(20),
                                      "backoff": {"init_backoff": _seconds(0.1), "max_backoff": _seconds(2),
                                                  "base": 2}},
                        **options)
        return cls(url, store, bucket, prefix)

    def name(self, key: str) -> str:
        return f"{self.url}/{key}" if key else self.url

    @contextlib.contextmanager
    def errors(self, key: str = ""):
        """Turns the client's failures into one line naming the object: FileNotFoundError for a missing object,
        ValueError for a missing bucket, refused credentials or an endpoint that does not answer."""
        from obstore import exceptions as obx

        try:
            yield
        except (obx.NotFoundError, FileNotFoundError) as exc:
            if "NoSuchBucket" in str(exc):
                raise ValueError(f"{self.url}: the bucket {self.bucket!r} does not exist (create it, or check the "
                                 "URL and the endpoint the client uses)") from None
            raise FileNotFoundError(f"{self.name(key)} does not exist") from None
        except (obx.PermissionDeniedError, obx.UnauthenticatedError) as exc:
            raise self._refused(str(exc)) from None
        except obx.GenericError as exc:
            text = str(exc)
            if "403 Forbidden" in text or "401 Unauthorized" in text:
                raise self._refused(text) from None
            if "NoSuchBucket" in text:
                raise ValueError(f"{self.url}: the bucket {self.bucket!r} does not exist (create it, or check the "
                                 "URL and the endpoint the client uses)") from None
            if "error sending request" in text or "Connection refused" in text or "dns error" in text \
                    or "timed out" in text.lower():
                endpoint = self.store.config.get("endpoint", "the default AWS endpoint")
                raise ValueError(f"{self.url}: the object store at {endpoint} does not answer (check "
                                 "AWS_ENDPOINT_URL or the profile's endpoint_url, and the network)") from None
            raise ValueError(f"{self.name(key)}: {text.splitlines()[0]}") from None

    def _refused(self, text: str) -> ValueError:
        code = re.search(r"<Code>([^<]+)</Code>", text)
        reason = code.group(1) if code else "access denied"
        return ValueError(f"{self.url}: the object store refused the credentials ({reason}); check AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY / AWS_PROFILE (s3://) or the "
                          "profile's credentials_provider (msc://)")

    def get(self, key: str) -> bytes:
        """The whole object ``key``; FileNotFoundError."""
        import obstore

        with self.errors(key):
            return bytes(obstore.get(self.store, key).bytes())

    def read_pieces(self, key: str, piece_bytes: int = PIECE_BYTES) -> Iterator[bytes]:
        """``key``'s bytes in pieces of at least ``piece_bytes`` (the last one shorter), streamed from one GET as
        they are consumed; FileNotFoundError."""
        import obstore

        with self.errors(key):
            stream = obstore.get(self.store, key).stream(min_chunk_size=piece_bytes)
        while True:
            with self.errors(key):
                piece = next(stream, None)
            if piece is None:
                return
            yield bytes(piece)

    def write_pieces(self, key: str, pieces: Iterable[bytes], part_bytes: int = MIN_PART_BYTES) -> None:
        """Writes ``key`` from ``pieces`` as they come, atomically: one PUT when they add up to at most
        ``part_bytes``, else a multipart upload of ``part_bytes`` parts (:data:`UPLOAD_CONCURRENCY`) completed only
        once ``pieces`` ends (aborted if it raises: nothing appears). ValueError for parts below S3's 5 MiB."""
        import obstore

        if part_bytes < MIN_PART_BYTES:
            raise ValueError(f"{self.url}: part_bytes={part_bytes} is below S3's smallest multipart part "
                             f"({MIN_PART_BYTES} bytes)")
        pieces = iter(pieces)
        first, held = collections.deque(), 0
        for piece in pieces:
            first.append(piece)
            held += len(piece)
            if held > part_bytes:
                break
        else:
            self.put(key, b"".join(first))
            return
        del piece
        with self.errors(key):
            obstore.put(self.store, key, _handed_on(first, pieces), use_multipart=True, chunk_size=part_bytes,
                        max_concurrency=UPLOAD_CONCURRENCY)

    def head(self, key: str) -> dict | None:
        """``key``'s metadata (``size``, ``e_tag``, ``last_modified``), or None when it does not exist."""
        import obstore

        try:
            with self.errors(key):
                return obstore.head(self.store, key)
        except FileNotFoundError:
            return None

    def exists(self, key: str) -> bool:
        return self.head(key) is not None

    def tail(self, key: str, nbytes: int) -> tuple[bytes, int]:
        """(the last ``nbytes`` bytes of ``key`` (all of it when shorter), its size): one request."""
        import obstore

        with self.errors(key):
            result = obstore.get(self.store, key, options={"range": {"suffix": int(nbytes)}})
            return bytes(result.bytes()), result.meta["size"]

    def ranges(self, key: str, spans: list[tuple[int, int]]) -> list[bytes]:
        """The bytes of each (offset, length) of ``key``, ranges near each other fetched in one request."""
        import obstore

        if not spans:
            return []
        with self.errors(key):
            return [bytes(part) for part in obstore.get_ranges(
                self.store, key, starts=[int(offset) for offset, _ in spans],
                lengths=[int(length) for _, length in spans], coalesce=COALESCE)]

    def put(self, key: str, data: bytes, mode=None) -> str:
        """Writes ``key`` (one atomic PUT); ``mode``: ``"create"`` (If-None-Match: the write fails with
        FileExistsError when ``key`` exists) or an ETag (If-Match: fails with ``ConditionFailed`` when ``key``
        changed). Returns the new ETag."""
        import obstore
        from obstore import exceptions as obx

        options = {} if mode is None else {"mode": mode if mode == "create" else {"e_tag": mode}}
        try:
            with self.errors(key):
                return obstore.put(self.store, key, data, **options)["e_tag"]
        except obx.AlreadyExistsError:
            raise FileExistsError(self.name(key)) from None
        except obx.PreconditionError:
            raise ConditionFailed(self.name(key)) from None
        except (obx.NotSupportedError, NotImplementedError) as exc:     # the latter: AWS_CONDITIONAL_PUT=disabled
            raise ConditionsUnsupported(f"{self.url}: the object store does not support conditional writes "
                                        f"({str(exc).splitlines()[0]})") from None

    def delete(self, keys) -> None:
        """Deletes the objects ``keys`` (absent ones are no error)."""
        import obstore

        keys = [keys] if isinstance(keys, str) else list(keys)
        with self.errors():
            for begin in range(0, len(keys), 1000):
                obstore.delete(self.store, keys[begin:begin + 1000])

    def keys(self, prefix: str = "") -> list[str]:
        """Every object key under ``prefix`` (relative to the store's prefix), sorted."""
        import obstore

        with self.errors(prefix):
            return sorted(meta["path"] for batch in obstore.list(self.store, prefix or None) for meta in batch)

    def is_empty(self, ignore: str = "") -> bool:
        """Whether no object but ``ignore`` lies under the store's prefix (one listing request of two keys; the
        empty folders some servers keep after a deletion do not count)."""
        import obstore

        with self.errors():
            first = next(iter(obstore.list(self.store, chunk_size=2)), [])
        return all(meta["path"] == ignore for meta in first)

    def sizes(self) -> dict[str, int]:
        """{key: bytes} of every object under the store's prefix."""
        import obstore

        with self.errors():
            return {meta["path"]: meta["size"] for batch in obstore.list(self.store) for meta in batch}

    def entries(self, prefix: str = "") -> tuple[list[str], list[str]]:
        """(the sub-prefixes, the objects) directly under ``prefix`` (one level, like a folder's listing), names
        relative to ``prefix``, sorted."""
        import obstore

        base = prefix.strip("/")
        with self.errors(prefix):
            found = obstore.list_with_delimiter(self.store, base or None)
        cut = len(base) + 1 if base else 0
        return (sorted(name.rstrip("/")[cut:] for name in found["common_prefixes"]),
                sorted(meta["path"][cut:] for meta in found["objects"]))

    def folders(self) -> list[str]:
        """The sub-prefixes directly under the store's prefix (its arrays' folders)."""
        return self.entries()[0]

    def zarr_store(self, read_only: bool = False):
        """zarr's store of this prefix (zarr 3's ``ObjectStore`` over the same obstore client)."""
        import zarr.storage

        return zarr.storage.ObjectStore(self.store, read_only=read_only)


def _handed_on(first: "collections.deque[bytes]", rest: Iterator[bytes]) -> Iterator[bytes]:
    """The pieces ``first`` then ``rest``, each held here only until it is handed on (``itertools.chain`` would hold
    ``first`` to the end: a part's worth of pieces more per upload)."""
    while first:
        yield first.popleft()
    yield from rest


class ConditionFailed(ValueError):
    """A conditional write whose condition (If-Match) did not hold: another writer changed the object."""


class ConditionsUnsupported(ValueError):
    """The object store rejects conditional writes (If-None-Match / If-Match)."""


def _seconds(value: float):
    import datetime

    return datetime.timedelta(seconds=value)


def _aws_options() -> dict:
    """The S3 settings every AWS client reads: ``AWS_ENDPOINT_URL(_S3)``, ``AWS_REGION``/``AWS_DEFAULT_REGION``,
    and, for ``AWS_PROFILE`` (or ``default``), the profile's keys and region from ``~/.aws``; obstore reads the
    ``AWS_*`` key variables itself."""
    options = {}
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    if endpoint:
        options["endpoint"] = endpoint
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    if "AWS_ACCESS_KEY_ID" not in os.environ:
        profile = os.environ.get("AWS_PROFILE", "default")
        files = configparser.ConfigParser()
        files.read([os.path.expanduser(os.environ.get("AWS_SHARED_CREDENTIALS_FILE", "~/.aws/credentials"))])
        if files.has_section(profile):
            section = files[profile]
            options |= {key: section[name] for key, name in (("access_key_id", "aws_access_key_id"),
                                                               ("secret_access_key", "aws_secret_access_key"),
                                                               ("token", "aws_session_token")) if name in section}
        config = configparser.ConfigParser()
        config.read([os.path.expanduser(os.environ.get("AWS_CONFIG_FILE", "~/.aws/config"))])
        section = profile if profile == "default" else f"profile {profile}"
        if not region and config.has_section(section):
            region = config[section].get("region")
    if region:
        options["region"] = region
    return options


def _msc_profile(url: str, profile: str) -> tuple[dict, str]:
    """(S3Store options, base path) of the multi-storage-client profile ``profile`` (its own config lookup:
    ``MSC_CONFIG`` or its default paths); ValueError (one line) for a missing or non-S3 profile."""
    try:
        from multistorageclient import StorageClientConfig
    except ImportError:
        raise ValueError(f"{url}: msc:// needs multi-storage-client (pip install multi-storage-client)") from None
    config, _ = StorageClientConfig.read_msc_config()
    found = (config or {}).get("profiles", {}).get(profile)
    if found is None:
        raise ValueError(f"{url}: multi-storage-client has no profile {profile!r} (its config: $MSC_CONFIG or "
                         "~/.msc_config.yaml)")
    provider = found.get("storage_provider") or {}
    if provider.get("type") not in ("s3", "s8k"):
        raise ValueError(f"{url}: the profile {profile!r} is of type {provider.get('type')!r}; stores on msc:// "
                         "need an S3 profile (type s3)")
    settings = provider.get("options") or {}
    options = _aws_options()
    if settings.get("endpoint_url"):
        options["endpoint"] = settings["endpoint_url"]
    if settings.get("region_name"):
        options["region"] = settings["region_name"]
    credentials = (found.get("credentials_provider") or {}).get("options") or {}
    for key, name in (("access_key_id", "access_key"), ("secret_access_key", "secret_key"),
                      ("token", "session_token")):
        if credentials.get(name):
            options[key] = os.path.expandvars(credentials[name])
    return options, settings.get("base_path", "")
