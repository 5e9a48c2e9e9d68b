"""The checkpoint benchmark behind ``tools/benchmark.py``.

One module per role:

* :mod:`.config`    the options of one benchmark run (``BenchConfig``);
* :mod:`.launch`    start N ranks (spawned processes, gloo on CPU, NCCL with GPUs);
* :mod:`.probes`    the physical limits: memory copy and sequential write + fsync bandwidth;
* :mod:`.workloads` the data saved: a synthetic sharded state dict and the GPT example's
  model + optimizer;
* :mod:`.memory`    resident memory sampling (peak RSS) and proportional set size (PSS);
* :mod:`.savers`    the save methods compared: ours and megatron-core's own, behind one interface;
* :mod:`.dcp_saver` PyTorch DCP's ``save`` and ``async_save`` behind the same interface;
* :mod:`.rank_job`  what every rank runs: N consecutive saves of one method, timed;
* :mod:`.report`    aggregation over ranks, the targets, the table, JSON and plots.
* :mod:`.lost_time` what every rank runs for ``--lost-time``: the GPT example's training
  loop with saves of one method, every iteration timed;
* :mod:`.lost_time_report` lost time per save, its targets, tables and plot;
* :mod:`.lost_time_run` the ``--lost-time*`` options and launches.

Stand-alone micro-benchmarks isolate one step each:

* :mod:`.bucket_write`  one bucket written by the background writer against a plain
  write + fsync of the same bytes (``python tools/bench/bucket_write.py -h``);
* :mod:`.finalize_cost` the phases of a save's finalization at a given item count;
* :mod:`.object_store` our async save to an S3 endpoint against boto3's multipart upload
  of the same bytes (``python tools/benchmark.py --object-store -h``).

Everything here is tooling: it prints, spawns processes and draws, and never changes the
library under ``megatron_async/``.
"""
