#!/usr/bin/env bash
# The core install (`pip install .`, no extras) is what a trainer needs to read training shards: check that it
# imports dflash_queue.training and runs the CLI without the workers' dependencies.
set -euo pipefail
cd "$(dirname "$0")/.."
venv="$(mktemp -d)/core"
python3 -m venv "$venv"
"$venv/bin/pip" install -q torch==2.13.0
"$venv/bin/pip" install -q .
"$venv/bin/python" -c "import dflash_queue.training, dflash_queue.shards.reader, dflash_queue.exports.sample_files"
"$venv/bin/dflash-queue" --help >/dev/null
for module in celery redis transformers boto3 flower matplotlib pyarrow; do
  if "$venv/bin/python" -c "import $module" 2>/dev/null; then
    echo "the core install pulled in $module" >&2
    exit 1
  fi
done
echo "core install: dflash_queue.training imports without the extras"
rm -rf "$(dirname "$venv")"
