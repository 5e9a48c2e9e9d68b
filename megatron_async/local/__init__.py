"""Local checkpoints: saved often to node-local storage, replicated to peer nodes.

The building blocks of nvidia-resiliency-ext's ``checkpointing.local`` surface (served
by :mod:`megatron_async.nvrx`), one role per module:

* :mod:`.state_dict` (every rank): ``TensorAwareStateDict``, the base megatron-core's
  ``MCoreTensorAwareStateDict`` derives from, and ``BasicTensorAwareStateDict`` for
  plain nested dicts and lists;
* :mod:`.cliques` (every rank): which ranks keep replicas of which rank's part
  (``parse_group_sequence``, ``CliqueReplicationStrategy``);
* :mod:`.parts` (every rank): a holder directory's part files and their records (size,
  xxh3 digest, the job's identity), listed, read back verified (with the file's version
  as hashed), mapped to send, and removed;
* :mod:`.part_output` (background writer; every rank at recovery): one part written
  through the local bucket file (aligned chunks hashed there, ``O_DIRECT``), then its
  record, durably; at recovery, a part received from a peer straight into its file;
* :mod:`.recovery` (every rank): the pure decision of which iteration to recover and
  which intact copy each rank reads;
* :mod:`.transport` (the store's address found in the training process, the rest in the
  background writer): the job's store, this node's address, messages between writers;
* :mod:`.exchange` (training process): where one save's part is replicated, and the
  finalize step that forgets a failed save's store key;
* :mod:`.part_replication` (background writer): one save's part streamed to the clique
  peers while it is written, and theirs kept; :mod:`.replica_receiver` admits and writes
  theirs, each replica verified against its owner's digest before it is acked;
* :mod:`.part_writer` (background writer): one save's part written from its staged
  ``torch.save`` records, replicated as it is written;
* :mod:`.manager` (every rank): ``LocalCheckpointManager``, whose ``save`` stages on the
  training thread and returns the request;
* :mod:`.retention` (every rank): which iterations a holder directory keeps, and the
  save's finalize step that applies it;
* :mod:`.recover` (every rank): ``find_latest``'s agreed recovery, verified parts moved
  between ranks in bulk, from and into their files, and ``load``'s mapping of the
  verified file.
"""
