"""Write buckets and the files they become: the model the stages above share.

Below the writer, the staging and the storage backends, and importing none of them
(nor any other package of the library): each of those stages works on the same buckets.

* :mod:`.layout` (trainer, every rank): a *bucket*, the content of one ``.distcp`` file;
  which items share a file (size-balanced), the prepared write and its staging key;
* :mod:`.bucket_file` (background writer): a bucket's output, gathered in chunks, every
  item hashed on its way (xxh3, the digest the checksum records of
  :mod:`megatron_async.integrity.checksums` name), or through a caller's ``open_file``;
* :mod:`.direct_io` (background writer): the local file, written with ``O_DIRECT``.
"""
