"""trl_es.launch.run_worker / run_workers: one job per spec file, in fresh processes."""

import json

import pytest

from trl_es.launch import run_worker, run_workers

SCRIPT = """
import json, os, sys
with open(sys.argv[2]) as f:
    spec = json.load(f)
if spec.get("fail"):
    sys.exit(3)
with open(spec["result"], "w") as f:
    json.dump({"double": 2 * spec["x"], "threads": os.environ["OMP_NUM_THREADS"]}, f)
"""


def test_workers_run_every_spec_and_return_results_in_order(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    specs = [{"x": x, "result": str(tmp_path / f"r{x}.json")} for x in range(5)]
    results = run_workers(str(script), specs, max_parallel=2)
    assert [r["double"] for r in results] == [0, 2, 4, 6, 8]
    assert run_worker(str(script), {"x": 21, "result": str(tmp_path / "one.json")}, num_processes=1,
                      threads=1) == {"double": 42, "threads": "1"}
    with pytest.raises(RuntimeError, match="failed"):
        run_workers(str(script), [{"x": 1, "fail": True, "result": str(tmp_path / "f.json")}], max_parallel=1)
    assert json.loads((tmp_path / "r3.json").read_text())["double"] == 6


def test_a_stale_result_is_not_read_as_this_runs(tmp_path):
    """A result file left by an earlier run is removed before the job starts: a worker that writes nothing fails
    loudly instead of returning the old result."""
    script = tmp_path / "silent.py"
    script.write_text("import sys\n")  # exits 0, writes no result
    stale = tmp_path / "r.json"
    stale.write_text('{"x": "old"}')
    with pytest.raises(RuntimeError, match="wrote no result"):
        run_worker(str(script), {"result": str(stale)}, num_processes=1)
    assert not stale.exists()
