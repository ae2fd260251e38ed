"""profiles/plan_check.py at a tiny size: it runs to its JSON, and its recorded step's
prediction at the plan's own costs is the plan's prediction (the same simulation)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.distributed

ROOT = Path(__file__).resolve().parents[1]
TINY = "--vocab 64 --hidden 16 --layers 4 --heads 2 --batch 8 --seq-len 8 --microbatches 4"


@pytest.mark.slow  # a profiles/ script measuring two splits: the slow lane
@pytest.mark.parametrize("model", ["builtin", "hf"])
def test_plan_check_measures_both_splits_and_explains_the_gap(model: str, tmp_path: Path) -> None:
    if model == "hf":
        pytest.importorskip("transformers")
    out = tmp_path / "plan.json"
    cmd = [sys.executable, str(ROOT / "profiles" / "plan_check.py"), "--model", model]
    cmd += [*TINY.split(), "--rounds", "1", "--reps", "1", "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["model"]["model"] == model
    assert sum(data["splits"]["planned"]) == sum(data["splits"]["even"]) == 4
    assert set(data["measured_median_s"]) == {
        "even",
        "planned",
        "one process",
        "one process, one rank's cores",
    }
    for name in ("even", "planned"):
        rec = data["recorded_step"][name]
        assert rec["predicted_s"] == pytest.approx(data["predicted_s"][name], rel=1e-12)
        assert len(rec["actions_over_alone"]) == 2 and all(x > 0 for x in rec["actions_over_alone"])
        for step, actions, outside in zip(rec["step_s"], rec["actions_s"], rec["outside_s"]):
            assert outside == pytest.approx(step - actions)
