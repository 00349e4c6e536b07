#!/usr/bin/env bash
# API reference from the docstrings (pdoc, the `docs` extra) into docs/api/, plus the op table.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
"$PY" docs/ops_table.py
"$PY" -m pdoc --docformat restructuredtext -o "${1:-docs/api}" meganeura
echo "docs: ${1:-docs/api}/index.html, docs/execution-model.md, docs/ops.md"
