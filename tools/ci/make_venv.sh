#!/usr/bin/env bash
# Create a fresh virtual environment with one megatron-core generation and this package.
#
#   bash tools/ci/make_venv.sh VENV_DIR 0.16.1|0.19.2
#
# 0.16.x installs normally. megatron-core 0.17+ declares Python >= 3.12 and ships cp312
# wheels only; its Python code runs on 3.11 once triton is installed, so for those versions
# the wheel is downloaded for 3.12 and its pure-Python files (everything but the one
# compiled dataset helper) are unpacked, with its .dist-info, into the venv: pip then sees
# megatron-core as installed and never resolves another one. This is a test harness for
# machines without Python 3.12; users run 0.17+ on Python 3.12.
# torch==2.13.0 is installed first and alone, so that pip never resolves a CUDA build.
set -euo pipefail

VENV_DIR="${1:?usage: make_venv.sh VENV_DIR MCORE_VERSION}"
MCORE_VERSION="${2:?usage: make_venv.sh VENV_DIR MCORE_VERSION}"
REPO_ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
PYTHON="${PYTHON:-python3}"

rm -rf "$VENV_DIR"
"$PYTHON" -m venv "$VENV_DIR"
PY="$VENV_DIR/bin/python"
pip_quiet() { "$PY" -m pip --disable-pip-version-check -q "$@" 2> >(grep -v '^WARNING: Location' >&2); }

pip_quiet install "torch==2.13.0"
case "$MCORE_VERSION" in
  0.16.*)
    pip_quiet install "megatron-core==$MCORE_VERSION"
    ;;
  *)
    wheels="$VENV_DIR/wheels"
    pip_quiet download --no-deps --python-version 3.12 --only-binary=:all: \
        "megatron-core==$MCORE_VERSION" -d "$wheels"
    "$PY" - "$wheels"/megatron_core-"$MCORE_VERSION"-*.whl <<'PYEOF'
import csv, os, sys, sysconfig, zipfile
wheel = sys.argv[1]
site = sysconfig.get_paths()["purelib"]
with zipfile.ZipFile(wheel) as archive:
    for info in archive.infolist():
        if not info.filename.endswith(".so"):
            archive.extract(info, site)
record = next(
    os.path.join(site, d, "RECORD") for d in os.listdir(site)
    if d.startswith("megatron_core-") and d.endswith(".dist-info")
)
rows = [row for row in csv.reader(open(record)) if row and not row[0].endswith(".so")]
with open(record, "w", newline="") as stream:
    csv.writer(stream).writerows(rows)
PYEOF
    # megatron-core's own requirements, and triton, which megatron.core imports at start.
    pip_quiet install numpy "packaging>=24.2"
    pip_quiet install --no-deps "triton==3.8.0"
    ;;
esac
# msc: object storage (use_msc); the test extra adds moto's S3 server for the loopback tests.
# Same for every generation (none of them pulls torch); the import check below fails the
# venv when one is missing, instead of the object-store tests skipping silently.
pip_quiet install -e "$REPO_ROOT[test,msc]"
"$PY" -W ignore -c "import multistorageclient, boto3, moto.server" \
    || { echo "make_venv.sh: the msc/test extras did not install" >&2; exit 1; }
"$PY" -W ignore -c "import megatron.core, megatron_async.mcore.generation as g, torch; \
print('venv', '$VENV_DIR', 'megatron-core', megatron.core.__version__, g.GENERATION, 'torch', torch.__version__)"
