#!/usr/bin/env bash
# The cuda plugin's self-check on a GPU machine, in one go: prints the table and writes the JSON
# report to ${OUT:-.}/selfcheck.json; exits with the self-check's status. Needs torch with CUDA;
# WHEELS=dir installs msgspec, pyzmq and structlog from local wheels (images without network).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
if [[ -n "${WHEELS:-}" ]]; then
    python -m pip install --quiet --no-index --find-links "$WHEELS" msgspec pyzmq structlog pyyaml
fi
python -m pip install --quiet --no-deps --no-build-isolation -e . || exit 2
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
report="${OUT:-.}/selfcheck.json"
python -m asyncrl.plugins.selfcheck --plugin cuda --json >"$report"
status=$?
python - "$report" <<'PY'
import sys

import msgspec

from asyncrl.plugins.selfcheck import Report, table

with open(sys.argv[1], "rb") as f:
    print(table(msgspec.json.decode(f.read(), type=Report)))
PY
exit "$status"
