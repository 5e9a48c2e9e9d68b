"""Write buckets and the files they become: the model the stages above share.

Below the writer, the staging and the storage backends, and importing none of them
(nor any other package of the library): each of those stages works on the same buckets.

* :mod:`.layout` (trainer, every rank): a *bucket*, the content of one ``.distcp`` file;
  which items share a file (size-balanced), the prepared write and its staging key;
* :mod:`.bucket_file` (background writer): the file one bucket's bytes go to, buffered
  or through a caller's ``open_file``, every item hashed on its way;
* :mod:`.direct_io` (background writer): the same file written with ``O_DIRECT``;
* :mod:`.hashing` (anywhere): the digest every item gets, shared by the bucket files and
  the checksum records of :mod:`megatron_async.integrity.checksums`.
"""
