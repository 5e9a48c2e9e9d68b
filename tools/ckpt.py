#!/usr/bin/env python
"""Checkpoint tool: ``python tools/ckpt.py {inspect,verify,list} ...``.

The same commands as ``python -m megatron_async``; kept here so that every tool of the
project is found under tools/.
"""

import sys

from megatron_async.cli import main

if __name__ == "__main__":
    sys.exit(main())
