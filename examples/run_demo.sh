#!/usr/bin/env bash
# Two-rank demo of asynchronous checkpointing with exact resume.
#
#   examples/run_demo.sh [CHECKPOINT_DIR] [extra pretrain_gpt.py flags...]
#
# Run 1 trains 30 iterations and saves a torch_dist checkpoint every 10 in the background
# (--async-save); run 2 is the same command with more iterations: it resumes from the
# checkpoint the tracker points to and goes on to 50. Works on CPU (gloo) and GPU (NCCL).
# Set NPROC to change the number of ranks.
set -euo pipefail

cd "$(dirname "$0")/.."
ckpt_dir="${1:-$(mktemp -d -t megatron_async_demo.XXXXXX)}"
shift $(( $# > 0 ? 1 : 0 ))
nproc="${NPROC:-2}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
# The repository root on the path, so the demo also runs from a checkout that is not installed.
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

flags=(
  --num-layers 4 --hidden-size 128 --num-attention-heads 4 --seq-length 64
  --micro-batch-size 4 --lr 3e-3
  --save "$ckpt_dir" --load "$ckpt_dir" --save-interval 10 --keep-last-n 2
  --async-save --log-interval 5
  "$@"
)

echo "== run 1: 30 iterations, async checkpoint every 10 iterations into $ckpt_dir"
torchrun --standalone --nproc-per-node "$nproc" examples/pretrain_gpt.py "${flags[@]}" --train-iters 30

echo
echo "== run 2: the same command with --train-iters 50 resumes from the latest checkpoint"
torchrun --standalone --nproc-per-node "$nproc" examples/pretrain_gpt.py "${flags[@]}" --train-iters 50

echo
echo "== $ckpt_dir (retention keeps the newest 2):"
ls "$ckpt_dir"
echo "latest_checkpointed_iteration.txt: $(cat "$ckpt_dir/latest_checkpointed_iteration.txt")"
