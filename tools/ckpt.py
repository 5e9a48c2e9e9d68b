#!/usr/bin/env python
"""Checkpoint tool: ``python tools/ckpt.py {inspect,verify,list} ...``.

The same commands as ``python -m megatron_async``, which it runs (so that it starts as
fast: ``list`` imports neither torch nor megatron-core); kept here so that every tool of
the project is found under tools/.
"""

import os
import sys

if __name__ == "__main__":
    os.execv(sys.executable, [sys.executable, "-m", "megatron_async", *sys.argv[1:]])
