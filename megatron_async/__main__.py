"""``python -m megatron_async``: the checkpoint command line (see megatron_async.cli)."""

import sys

from megatron_async.cli import main

if __name__ == "__main__":
    sys.exit(main())
