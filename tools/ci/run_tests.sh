#!/usr/bin/env bash
# Set up fresh test environments and run the tests against both megatron-core generations.
#
#   bash tools/ci/run_tests.sh            (what .ci/run calls)
#
# 1. megatron-core 0.16.1: the whole suite, plus the cross-generation checkpoint test
#    (which drives the 0.19.2 environment's interpreter).
# 2. megatron-core 0.19.2: what differs by generation (the strategy scenarios at 2 ranks,
#    faults, the saver (first-save planning), the nvidia-resiliency-ext module surface with
#    megatron-core's stock strategy, object storage on the loopback S3 server, the staging
#    budget's scenario on megatron-core's own queue, the GPT example's resume: sync
#    with TP 2 and the distributed optimizer, and the persistent worker with PP 2, and
#    megatron-core's MCoreTensorAwareStateDict through the local checkpoint manager).
# 3. megatron-core 0.17.1 and 0.18.2 (the generation in between: no registry, but still a
#    common.pt written by a plain function): the strategy-config unit tests and the strategy
#    scenarios that differ between generations, at 2 ranks.
# Every environment is created anew under .venv-ci/, so nothing installed by hand on the
# machine can hide a missing install step. Exits non-zero when any test fails.
set -euo pipefail
REPO_ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
cd "$REPO_ROOT"
ENVS="$REPO_ROOT/.venv-ci"
mkdir -p "$ENVS"

bash tools/ci/make_venv.sh "$ENVS/mcore016" 0.16.1
bash tools/ci/make_venv.sh "$ENVS/mcore019" 0.19.2
bash tools/ci/make_venv.sh "$ENVS/mcore017" 0.17.1
bash tools/ci/make_venv.sh "$ENVS/mcore018" 0.18.2

echo "== megatron-core 0.16.1: full suite =="
MEGATRON_ASYNC_OTHER_GENERATION_PYTHON="$ENVS/mcore019/bin/python" \
PATH="$ENVS/mcore016/bin:$PATH" \
    "$ENVS/mcore016/bin/python" -m pytest -q -p no:cacheprovider tests

echo "== megatron-core 0.19.2: strategy scenarios, faults, saver, nvrx surface, object storage, GPT resume =="
PATH="$ENVS/mcore019/bin:$PATH" \
    "$ENVS/mcore019/bin/python" -m pytest -q -p no:cacheprovider \
    tests/unit/mcore tests/unit/nvrx tests/unit/test_format.py tests/unit/storage tests/unit/saver \
    tests/functional/test_strategy.py tests/functional/test_faults.py \
    tests/functional/test_nvrx_surface.py tests/functional/test_object_store.py \
    tests/functional/test_staging_budget.py tests/functional/test_pretrain_gpt.py \
    tests/functional/test_local_checkpoints.py tests/unit/tools/test_bench_generations.py \
    -k "not 4ranks and (not test_staging_budget or megatron_core_queue) \
        and (not test_pretrain_gpt or resume_reproduces) \
        and (not test_local_checkpoints or megatron_core)"

for version in 017 018; do
    echo "== megatron-core ${version:0:1}.${version:1}: strategy config, generation-specific scenarios =="
    PATH="$ENVS/mcore$version/bin:$PATH" \
        "$ENVS/mcore$version/bin/python" -m pytest -q -p no:cacheprovider \
        tests/unit/mcore tests/functional/test_strategy.py \
        -k "not 4ranks and (not test_scenario or sync_save or stock_save or second_save or megatron_lm \
            or integrity or async_equals or fully_parallel or cached_metadata or deep_copy)"
done
