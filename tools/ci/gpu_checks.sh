#!/usr/bin/env bash
# Every CUDA check, in one command, on a machine with a GPU and a CUDA build of torch:
# the gpu-marked tests (CUDA staging to page-locked shared memory, overlapped staging on a
# side stream, the forked persistent worker of a CUDA trainer) and the device-to-host
# throughput into our staging memory against pinned memory.
#
#   bash tools/ci/gpu_checks.sh            # from the repository root, in the test venv
#
# Fails at once, saying so, where no CUDA device is visible (the tests would only skip).
set -euo pipefail
cd "$(dirname "$0")/../.."
python -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else "gpu_checks: torch sees no CUDA device (torch " + torch.__version__ + "); run this on a GPU machine with a CUDA build of torch")'
python -m pytest -q -m gpu -rs -p no:cacheprovider tests
python -m tools.bench.micro.d2h_throughput --mib 1024
