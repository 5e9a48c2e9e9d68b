"""The checkpoint benchmarks behind ``tools/benchmark.py``: a map of this folder.

The launching side (``tools/benchmark.py``'s process) parses options, starts launches and
reports; the rank side (every spawned rank) saves and times. One module per role:

* :mod:`.config`          the options of one run (``BenchConfig``) and the names of what it
  compares (stall variants, lost-time methods, the GPT example's flags per method);
* :mod:`.launch`          start N ranks (spawned processes, gloo on CPU, NCCL with GPUs);
* :mod:`.probes`          rank side: the physical limits, memory copy and sequential
  write + fsync bandwidth;
* :mod:`.gpt_example`     rank side: the GPT example's model, distributed optimizer and data,
  built as ``examples/pretrain_gpt.py`` builds them (``ExampleTrainer``);
* :mod:`.workloads`       rank side: the data the stall benchmark saves, a synthetic sharded
  state dict or the GPT example's model + optimizer;
* :mod:`.memory`          rank side: resident memory sampling (peak RSS) and PSS;
* :mod:`.methods`         rank side: the save methods every benchmark compares, one
  hierarchy (ours, megatron-core's own, PyTorch DCP, the GPT example's ``Checkpointer``);
* :mod:`.rank_job`        rank side of the stall and throughput benchmark: N consecutive
  saves of one method, timed;
* :mod:`.stall_run`       launching side of the stall and throughput benchmark: its
  launches, the physical limits, the host;
* :mod:`.results`         launching side: aggregation over ranks, the limits, the targets
  (what ``results.json`` holds);
* :mod:`.report`          launching side: the tables and text of ``report.md``;
* :mod:`.stall_plots`     launching side: the stall and planning plots (PNG);
* :mod:`.lost_time`       rank side of ``--lost-time``: the GPT example's training loop with
  saves of one method, every iteration timed;
* :mod:`.lost_time_run`   launching side of ``--lost-time``: its options and launches;
* :mod:`.lost_time_report` launching side: lost time per save, its targets, tables and plot;
* :mod:`.object_store`    ``tools/benchmark.py --object-store``: our async save to an S3
  endpoint against boto3's multipart upload of the same bytes (both sides);
* :mod:`.scale`           ``tools/benchmark.py --scale``: the coordinator's planning and
  commit for N simulated ranks (one process, our real code) against DCP's, per N;
* :mod:`.scale_plans`     the local plans and write results of N simulated ranks, per layout;
* :mod:`.scale_report`    launching side of ``--scale``: its table and plot;
* :mod:`.micro`           micro-benchmarks, one step each, run as modules
  (``python -m tools.bench.micro.bucket_write -h``).

Everything here is tooling: it prints, spawns processes and draws, and never changes the
library under ``megatron_async/``. Kept free of imports: a persistent worker imports this
package to unpickle a timed write (see :mod:`.methods`).
"""
