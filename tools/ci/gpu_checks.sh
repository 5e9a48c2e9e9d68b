#!/usr/bin/env bash
# Every CUDA check, in one command, on a machine with a GPU and a CUDA build of torch:
#
# 1. the gpu-marked tests: CUDA staging to page-locked shared memory, overlapped staging on
#    a side stream, the forked persistent worker of a CUDA trainer, async torch.save of
#    device tensors;
# 2. the device-to-host throughput into our staging memory against pinned memory;
# 3. the GPT example as a 2-rank NCCL job (with the gloo coordination group): exact resume
#    with the persistent worker and pipeline parallelism (1F1B), a SIGKILL during an async
#    save, and a resume from TP 2 to TP 1 and back. With one GPU the two ranks share it
#    (examples/gpt/devices.py); overlapped staging on CUDA is among the gpu-marked tests;
# 3b. the local checkpoint tier as an NCCL job: two torchrun "nodes" of 2 ranks on the one
#    GPU, fully_parallel, node 1's local directory lost: every rank resumes from its peers'
#    replicas (parts restored to their recorded CUDA devices) with the uninterrupted losses;
# 4. a measurement: the warm stall of device tensors, 4,000 x 16 KiB and then the same bytes
#    in 40 tensors, each beside one device-to-host copy of the state into pinned memory, one
#    copy per tensor, and a device gather + one copy: whether gathering many small device
#    tensors before the copy would pay (issue 24, item 4);
# 5. ours beside PyTorch DCP's async_save (a stager per save, and a reused DefaultStager) and
#    megatron-core's own async save (persistent and forked caller), same GPU, same run; a
#    method that hangs is cut after 90 s and reported as an error with its log.
#
#   bash tools/ci/gpu_checks.sh            # from the repository root, in the test venv
#   GPU_CHECKS_LOG_DIR=DIR bash tools/ci/gpu_checks.sh   # also keep each step's output in DIR
#
# On a GPU machine without megatron-core (Python 3.12, no network), carry its wheel:
#   pip download --no-deps --only-binary=:all: --python-version 3.12 megatron-core==0.19.2 -d .whl
# and there: pip install -q --no-deps --target /tmp/site .whl/*.whl &&
#   PYTHONPATH=/tmp/site PYTHON=python3 bash tools/ci/gpu_checks.sh
# Steps 1-4 took 220-304 s on an H200 (2026-11-27, -28); step 5 about 4 minutes (a method cut
# after 90 s included): give the command 590 s. Step 3b is new (2026-11-28, not yet run on a
# GPU; about 1 minute on CPU).
#
# Fails at once, saying so, where no CUDA device is visible (the tests would only skip).
# Every step runs even when an earlier one fails; the exit status says whether all passed.
set -uo pipefail
cd "$(dirname "$0")/../.."
PYTHON="${PYTHON:-$(command -v python || command -v python3)}"
LOG_DIR="${GPU_CHECKS_LOG_DIR:-$(mktemp -d -t gpu_checks.XXXXXX)}"
mkdir -p "$LOG_DIR"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

"$PYTHON" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else "gpu_checks: torch sees no CUDA device (torch " + torch.__version__ + "); run this on a GPU machine with a CUDA build of torch")' || exit 2

failed=()
step() {  # step NAME COMMAND...: run one check, keep its output, remember a failure
  local name="$1"; shift
  echo "== gpu_checks: $name"
  local start=$SECONDS
  "$@" 2>&1 | tee "$LOG_DIR/$name.log"
  local rc=${PIPESTATUS[0]}
  echo "== gpu_checks: $name: exit $rc after $((SECONDS - start)) s"
  [ "$rc" -eq 0 ] || failed+=("$name")
}

step gpu_tests "$PYTHON" -m pytest -q -m gpu -rs -p no:cacheprovider tests
step d2h_throughput "$PYTHON" -m tools.bench.micro.d2h_throughput --mib 1024
step gpt_nccl "$PYTHON" -m pytest -q -rs -p no:cacheprovider tests/functional/test_pretrain_gpt.py \
    -k "resume_reproduces and persistent or kill_during or other_parallelism and tp2-to-tp1"
step local_tier_nccl "$PYTHON" -m pytest -q -rs -p no:cacheprovider \
    tests/functional/test_pretrain_gpt_local_checkpoints.py -k "fully_parallel"
step warm_stall_cuda bash -c "for shape in '4000 16KiB' '40 1600KiB'; do set -- \$shape; \
    '$PYTHON' -m tools.bench.micro.warm_stall --device cuda --tensors \$1 --tensor-bytes \$2 \
    --callers persistent --saves 10 --phases || exit 1; done"
step compare "$PYTHON" tools/benchmark.py --ranks 1 --bytes-per-rank 256MiB --tensor-counts 100 \
    --saves 4 --memory-saves 2 --scaling-ranks 1 --launch-timeout-s 90 --workloads synthetic \
    --variants ours_persistent,dcp_async_thread,dcp_async_thread_staged,mcore_async_temporal,mcore_async_persistent \
    --out "$LOG_DIR/compare"

if [ "${#failed[@]}" -gt 0 ]; then
  echo "gpu_checks: FAILED: ${failed[*]} (logs in $LOG_DIR)"
  exit 1
fi
echo "gpu_checks: all passed (logs in $LOG_DIR)"
