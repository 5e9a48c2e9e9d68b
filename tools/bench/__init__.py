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

Everything here is tooling: it prints, spawns processes and draws, and never changes the
library under ``megatron_async/``.
"""
