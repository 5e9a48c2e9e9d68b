"""Stream one bucket into an object store as it is written (background writer).

:class:`ObjectStoreFileOpener` is the ``open_file`` that the writer's write paths get
when the checkpoint is an ``msc://`` URL: called, it opens like multi-storage-client's
``open`` (the reference API's ``open_file``); :func:`megatron_async.writer.bucket_io.write_bucket`
instead asks it for the bucket file (:meth:`~ObjectStoreFileOpener.open_bucket_file`): a
:class:`~megatron_async.buckets.bucket_file.BucketFile` whose bytes go to the store
instead of a local file, so everything else (DCP's byte layout, the xxh3 digest of every
item while it passes) is the same code as on POSIX:

* an S3-compatible profile gets an :class:`S3MultipartBucketFile`: bytes are gathered
  into parts of ``part_bytes`` and each full part is uploaded at once (a multipart
  upload, started with the first full part); memory per bucket stays about one part,
  and nothing is staged on local disk. A bucket smaller than one part is one PUT.
  ``finish`` completes the upload: the object exists only once the store acknowledged
  every part. Closing the file before that aborts the upload, so no part is left
  behind by a failed save (a killed process leaves its parts to the bucket's lifecycle
  rule for incomplete multipart uploads);
* a POSIX profile gets a buffered local file on the profile's directory.

The boto3 client is the one MSC built for the profile (its endpoint, credentials,
timeouts and retries).
"""

from __future__ import annotations

import logging
from typing import Any, Dict, List, Optional

from megatron_async.errors import ObjectStoreError
from megatron_async.storage.bounded_calls import REQUEST_TIMEOUT_S, call_with_deadline
from megatron_async.storage.client import import_msc, resolve
from megatron_async.buckets.bucket_file import BucketFile
from megatron_async.buckets.direct_io import LocalBucketFile

__all__ = [
    "DEFAULT_PART_BYTES",
    "MIN_PART_BYTES",
    "S3MultipartBucketFile",
    "ObjectStoreFileOpener",
]

logger = logging.getLogger(__name__)

MIN_PART_BYTES = 5 << 20
"""S3's smallest part of a multipart upload (all parts but the last)."""

DEFAULT_PART_BYTES = 16 << 20
"""Bytes per uploaded part: the memory one file's upload holds at a time."""


class S3MultipartBucketFile(BucketFile):
    """A bucket streamed to one S3 object (background writer; one thread per object).

    Args:
        s3_client: a boto3 S3 client.
        url: the ``msc://`` URL, for messages.
        hashing: hash every item (see :class:`BucketFile`).
        part_bytes: bytes per part (at least :data:`MIN_PART_BYTES`; the write options
            validate it).
        timeout_s: the deadline of every request (each part is one request).
    """

    def __init__(
        self, s3_client: Any, bucket: str, key: str, url: str, hashing: bool, part_bytes: int,
        timeout_s: float = REQUEST_TIMEOUT_S,
    ):
        super().__init__(bytearray(part_bytes), hashing)  # the chunk is the part
        self._s3 = s3_client
        self._bucket = bucket
        self._key = key
        self._url = url
        self._timeout_s = timeout_s
        self._upload_id: Optional[str] = None
        self._parts: List[Dict[str, Any]] = []
        self._completed = False

    def finish(self, use_fsync: bool) -> None:
        """Upload what is left and complete the object; it exists once this returns.

        ``use_fsync`` has no meaning here: the store acknowledges a part or the object
        only once it holds it durably.
        """
        if self._upload_id is None:
            body = bytes(self._view[:self._filled])
            self._request("PUT", lambda: self._s3.put_object(Bucket=self._bucket, Key=self._key, Body=body))
        else:
            super().finish(use_fsync)  # the last part
            parts = {"Parts": self._parts}
            self._request(
                "completing the multipart upload of",
                lambda: self._s3.complete_multipart_upload(
                    Bucket=self._bucket, Key=self._key, UploadId=self._upload_id, MultipartUpload=parts
                ),
            )
        self._filled = 0
        self._completed = True

    def close(self) -> None:
        """Abort an unfinished multipart upload (best effort: the save fails anyway)."""
        if self._completed or self._upload_id is None:
            return
        upload_id, self._upload_id = self._upload_id, None
        try:  # bounded: the store may be the reason the save failed
            self._request(
                "aborting the multipart upload of",
                lambda: self._s3.abort_multipart_upload(Bucket=self._bucket, Key=self._key, UploadId=upload_id),
            )
        except Exception as exc:  # cleanup after a failure that is reported already
            logger.warning(
                "aborting the multipart upload of %s failed (%s); the bucket's lifecycle rule "
                "for incomplete uploads will remove its parts",
                self._url,
                exc,
            )

    # -- the store ---------------------------------------------------------------------

    def _write_chunk(self, length: int) -> None:
        """Upload the chunk as the next part, starting the multipart upload with the first."""
        if self._upload_id is None:
            response = self._request(
                "starting a multipart upload of",
                lambda: self._s3.create_multipart_upload(Bucket=self._bucket, Key=self._key),
            )
            self._upload_id = response["UploadId"]
        number = len(self._parts) + 1
        body = bytes(self._view[:length])  # an abandoned request must not see the next part
        response = self._request(
            f"uploading part {number} of",
            lambda: self._s3.upload_part(
                Bucket=self._bucket, Key=self._key, UploadId=self._upload_id, PartNumber=number, Body=body
            ),
        )
        self._parts.append({"ETag": response["ETag"], "PartNumber": number})
        self._written += length

    def _request(self, what: str, call: Any) -> Any:
        return call_with_deadline(what, self._url, call, self._timeout_s)


def _s3_target(client: Any, path: str):
    """``(boto3 client, bucket, key)`` of an S3-compatible profile, or None for another kind.

    MSC does not expose its boto3 client publicly; this is the one place that reaches
    into it (multi-storage-client 1.x: ``StorageClient.delegate._storage_provider``).
    """
    from multistorageclient.providers.s3 import S3StorageProvider

    delegate = getattr(client, "delegate", client)
    provider = getattr(delegate, "_storage_provider", None)
    if not isinstance(provider, S3StorageProvider):
        return None
    full = provider._prepend_base_path(path).lstrip("/")
    bucket, _, key = full.partition("/")
    return provider._s3_client, bucket, key


class ObjectStoreFileOpener:
    """``open_file`` for ``msc://`` checkpoints (pickles to the background writer).

    Args:
        part_bytes: bytes per uploaded part of a bucket's multipart upload.
        timeout_s: the deadline of every request of an upload.
    """

    def __init__(self, part_bytes: int = DEFAULT_PART_BYTES, timeout_s: float = REQUEST_TIMEOUT_S):
        self.part_bytes = part_bytes
        self.timeout_s = timeout_s

    def __call__(self, url: str, mode: str = "rb", **kwargs: Any) -> Any:
        """Open ``url`` with multi-storage-client's ``open`` (code written to the reference API)."""
        return import_msc().open(url, mode, **kwargs)

    def open_bucket_file(self, url: str, hashing: bool) -> BucketFile:
        """Open the output of one bucket at ``url``: the streamed bucket file our write path
        uses (multipart, digests on the way).

        Raises:
            ObjectStoreUnavailableError: multi-storage-client is not installed.
            ObjectStoreError: the profile is neither S3-compatible nor POSIX.
        """
        client, path = resolve(url)
        local = client.get_posix_path(path)
        if local is not None:
            return LocalBucketFile(local, hashing, direct_io=False)
        target = _s3_target(client, path)
        if target is None:
            raise ObjectStoreError(
                f"{url}: the profile's storage provider cannot be streamed to; async saves to "
                "object storage support S3-compatible profiles (type s3, s8k, ...) and POSIX ones"
            )
        return S3MultipartBucketFile(*target, url, hashing, self.part_bytes, self.timeout_s)

