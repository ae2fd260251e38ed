#!/usr/bin/env bash
# Install as a user who does not clone: build the wheel, install it with its dependencies
# into a fresh venv outside the checkout, import every module of the installed package, and
# train 5 steps with the installed `graphpipe` command.
#
#   bash .ci/wheel_check.sh          # run from any directory; PYTHON picks the interpreter
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
py="${PYTHON:-python3}"
"$py" -m pip wheel -q --no-deps -w "$work/dist" "$repo"
"$py" -m venv "$work/venv"
. "$work/venv/bin/activate"
pip install -q torch==2.13.0 "$work"/dist/graphpipe-*.whl
cd "$work"  # nothing of the checkout on sys.path
python - "$repo" <<'PY'
import importlib
import pkgutil
import sys
from pathlib import Path

import graphpipe

repo = Path(sys.argv[1]).resolve()
where = Path(graphpipe.__file__).resolve()
assert repo not in where.parents, f"graphpipe imported from the checkout: {where}"
names = [m.name for m in pkgutil.walk_packages(graphpipe.__path__, "graphpipe.")]
sources = {
    ".".join(p.relative_to(repo).with_suffix("").parts).removesuffix(".__init__")
    for p in (repo / "graphpipe").rglob("*.py")
}
missing = sorted(sources - {"graphpipe", *names})
assert not missing, f"the wheel lacks {missing}"
for name in names:
    importlib.import_module(name)
print(f"wheel check: {len(names)} modules of {where.parent} import")
PY
graphpipe train --steps 5
