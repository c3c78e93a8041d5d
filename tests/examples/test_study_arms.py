"""examples/studies/_study/arms.py: the arm orchestration the study scripts share (no model: the jobs are stubs)."""

import dataclasses
import json
from dataclasses import dataclass, field

from _study.arms import JobArguments, Jobs, parse_arguments, saved_result, settings_of, write_results


@dataclass
class ToyArguments(JobArguments):
    output_dir: str = field(default="out", metadata={"help": "Where results go."})
    arms: list[str] = field(default_factory=lambda: ["a", "b"], metadata={"help": "Arms to run."})
    sigma: float = field(default=0.1, metadata={"help": "What a job computes with."})


def spec_of(args, arm, tmp_path):
    return {"kind": "train", "arm": arm, "args": dataclasses.asdict(args), "result": str(tmp_path / f"{arm}.json")}


def toy_job(calls):
    def job(spec):
        calls.append(spec["arm"])
        result = {"spec": spec, "value": len(calls)}
        with open(spec["result"], "w") as f:
            json.dump(result, f)
        return result
    return job


def test_a_saved_result_is_reused_unless_what_the_job_computes_changed(tmp_path):
    jobs, calls = Jobs(__file__, "toy", not_in_result=("arms",)), []
    args = parse_arguments(ToyArguments, ["--in_process", "true", "--arms", "a"])
    assert jobs.not_in_result == ("reuse", "worker", "arms")
    assert jobs.run(args, spec_of(args, "a", tmp_path), toy_job(calls))["value"] == 1
    # another arm list or reuse/worker: the same job, read back
    wider = parse_arguments(ToyArguments, ["--in_process", "true", "--arms", "a", "b", "--worker", "w.json"])
    assert jobs.run(wider, spec_of(wider, "a", tmp_path), toy_job(calls))["value"] == 1 and calls == ["a"]
    # another sigma: run again; and reuse off: run again
    other = parse_arguments(ToyArguments, ["--in_process", "true", "--sigma", "0.2"])
    assert jobs.run(other, spec_of(other, "a", tmp_path), toy_job(calls))["value"] == 2
    fresh = parse_arguments(ToyArguments, ["--in_process", "true", "--sigma", "0.2", "--reuse", "false"])
    assert jobs.run(fresh, spec_of(fresh, "a", tmp_path), toy_job(calls))["value"] == 3 and calls == ["a"] * 3


def test_run_all_runs_only_the_jobs_not_saved_and_returns_every_result(tmp_path, capsys):
    jobs, calls = Jobs(__file__, "toy"), []
    args = parse_arguments(ToyArguments, ["--in_process", "true"])
    jobs.run(args, spec_of(args, "a", tmp_path), toy_job(calls))
    results = jobs.run_all(args, [spec_of(args, arm, tmp_path) for arm in ("a", "b", "c")], toy_job(calls),
                           "evaluating {} arm(s)")
    assert calls == ["a", "b", "c"] and [r["value"] for r in results] == [1, 2, 3]
    assert "[toy] evaluating 2 arm(s)" in capsys.readouterr().out


def test_settings_and_saved_results(tmp_path):
    args = ToyArguments(output_dir=str(tmp_path), arms=["a"])
    settings = settings_of(args, ("arms",))
    assert settings == {"eval_workers": None, "in_process": False, "worker": None, "sigma": 0.1}
    path = tmp_path / "seed0.json"
    assert saved_result(str(path), settings) is None  # nothing saved
    path.write_text(json.dumps({"settings": settings, "run": 7}))
    assert saved_result(str(path), settings_of(ToyArguments(arms=["a", "b"]), ("arms",)))["run"] == 7
    assert saved_result(str(path), settings, reuse=False) is None
    assert saved_result(str(path), settings_of(ToyArguments(sigma=0.3), ("arms",))) is None


def test_write_results_writes_the_json_the_table_and_the_plots(tmp_path, capsys):
    plotted = []
    write_results(str(tmp_path), {"table": [1, 2]}, "| a |\n", lambda: plotted.append(True))
    assert json.loads((tmp_path / "results.json").read_text()) == {"table": [1, 2]}
    assert (tmp_path / "results.md").read_text() == "| a |\n" and plotted == [True]
    assert capsys.readouterr().out == "| a |\n\n"

