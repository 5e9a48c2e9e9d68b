"""Micro-benchmarks: each isolates one step of a save and prints a table (one process).

Run each as a module from the repository root, for example
``python -m tools.bench.micro.bucket_write -h``:

* :mod:`.bucket_write`      one bucket written by the background writer against a plain
  write + fsync of the same bytes;
* :mod:`.direct_write_cpu`  the CPU one bucket's direct-I/O write costs the writer;
* :mod:`.finalize_cost`     the phases of a save's finalization at a given item count;
* :mod:`.worker_start_cost` what starting the persistent worker costs the trainer, by start
  method;
* :mod:`.d2h_throughput`    device-to-host copies into our staging memory against pinned
  memory (GPU only);
* :mod:`.save_profile`      cProfile of one warm save of the GPT example and of its finalize;
* :mod:`.warm_stall`        the warm stall of thousands of small tensors against one memory
  copy of them, per caller (``--profile``: cProfile of one warm save).

Tooling only: they print, and never change the library under ``megatron_async/``.
"""
