"""trl_es.files: one writer per file (the main process), every file complete or absent, silent non-writes loud."""

import json
import os
import stat
from types import SimpleNamespace

import pytest
import torch.distributed as dist
from example_script import example_script

from trl_es import files
from trl_es.files import atomic_path, is_main_process, process_rank, require_files, save_figure, write_json, write_text
from trl_es.files import SAVED_MODEL_FILES, save_trainer_model


@pytest.fixture
def rank(monkeypatch):
    """Set this process's launcher rank (``RANK``), torch.distributed being uninitialised."""
    assert not (dist.is_available() and dist.is_initialized())

    def set_rank(value: int | str | None):
        if value is None:
            monkeypatch.delenv("RANK", raising=False)
        else:
            monkeypatch.setenv("RANK", str(value))

    return set_rank


@pytest.fixture
def umask():
    """Run with a given umask, restored afterwards."""
    old = os.umask(0o022)
    os.umask(old)
    yield lambda mask: os.umask(mask)
    os.umask(old)


# ---------------------------------------------------------------------------------------------- atomic writes
def test_write_json_matches_json_dump_with_a_final_newline(tmp_path):
    obj = {"b": [1, 2.5, None], "a": {"nested": "é"}, "nan": float("nan")}
    path = tmp_path / "out.json"
    write_json(path, obj)
    assert path.read_text(encoding="utf-8") == json.dumps(obj, indent=2) + "\n"
    write_json(path, obj, indent=None, sort_keys=True)
    assert path.read_text(encoding="utf-8") == json.dumps(obj, sort_keys=True) + "\n"


@pytest.mark.parametrize("bad, kwargs, error", [({"x": object()}, {}, TypeError),
                                                ({"x": float("nan")}, {"allow_nan": False}, ValueError)])
def test_failed_serialisation_keeps_the_old_file_and_leaves_no_temp_file(tmp_path, bad, kwargs, error):
    path = tmp_path / "result.json"
    write_json(path, {"old": True})
    with pytest.raises(error):
        write_json(path, bad, **kwargs)
    assert json.loads(path.read_text()) == {"old": True}
    assert os.listdir(tmp_path) == ["result.json"]
    with pytest.raises(error):
        write_json(tmp_path / "new.json", bad, **kwargs)
    assert os.listdir(tmp_path) == ["result.json"]  # a file that did not exist stays absent


def test_atomic_path_error_mid_write_keeps_the_old_bytes(tmp_path):
    path = tmp_path / "weights.bin"
    path.write_bytes(b"old")
    with pytest.raises(RuntimeError, match="crash"):
        with atomic_path(path) as tmp:
            assert os.path.dirname(tmp) == str(tmp_path) and tmp.endswith(".bin") and tmp != str(path)
            with open(tmp, "wb") as f:
                f.write(b"half")
            raise RuntimeError("crash")
    assert path.read_bytes() == b"old"
    assert os.listdir(tmp_path) == ["weights.bin"]
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        f.write(b"new")
    assert path.read_bytes() == b"new"
    assert os.listdir(tmp_path) == ["weights.bin"]


def test_atomic_path_creates_the_folder(tmp_path):
    write_text(tmp_path / "a" / "b" / "c.md", "table\n")
    assert (tmp_path / "a" / "b" / "c.md").read_text() == "table\n"


@pytest.mark.parametrize("mask", [0o022, 0o002, 0o077])
def test_permissions_are_the_umask_ones_not_0600(tmp_path, umask, mask):
    umask(mask)
    with open(tmp_path / "plain.txt", "w") as f:  # what a bare open() gives
        f.write("x")
    write_text(tmp_path / "atomic.txt", "x")
    write_json(tmp_path / "atomic.json", {})
    expected = 0o666 & ~mask
    assert stat.S_IMODE(os.stat(tmp_path / "plain.txt").st_mode) == expected
    assert stat.S_IMODE(os.stat(tmp_path / "atomic.txt").st_mode) == expected
    assert stat.S_IMODE(os.stat(tmp_path / "atomic.json").st_mode) == expected


def test_save_figure_writes_a_png_and_no_temp_file(tmp_path):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(2, 2))
    FigureCanvasAgg(fig)
    fig.add_subplot().plot([0, 1], [1, 0])
    save_figure(fig, tmp_path / "plot.png", dpi=50)
    assert (tmp_path / "plot.png").read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    assert os.listdir(tmp_path) == ["plot.png"]


def test_plot_pass_at_k_curves_is_atomic(tmp_path):
    from trl_es.analysis import plot_pass_at_k_curves

    path = tmp_path / "pass_at_k.png"
    plot_pass_at_k_curves({"a": [0.1, 0.2]}, [1, 2], path)
    assert path.read_bytes().startswith(b"\x89PNG")
    with pytest.raises(ValueError):
        plot_pass_at_k_curves({"a": [0.1]}, [1, 2], path)
    assert path.read_bytes().startswith(b"\x89PNG") and os.listdir(tmp_path) == ["pass_at_k.png"]


# ---------------------------------------------------------------------------------------------- require_files
def test_require_files_names_what_is_missing_or_empty(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"")  # empty counts as missing
    with pytest.raises(RuntimeError, match="model.safetensors") as err:
        require_files(tmp_path, ["config.json", "model.safetensors"], "the saved model")
    assert "config.json'" not in str(err.value) and "the saved model" in str(err.value)
    assert "rank 0" in str(err.value)
    with pytest.raises(RuntimeError, match="tokenizer.json"):
        require_files(tmp_path, ["tokenizer.json"])


def test_require_files_accepts_any_of_a_tuple(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors.index.json").write_text("{}")
    require_files(tmp_path, SAVED_MODEL_FILES)  # the index stands for the weights
    require_files(tmp_path, [("missing.bin", "config.json")])
    with pytest.raises(RuntimeError, match="a.bin or b.bin"):
        require_files(tmp_path, [("a.bin", "b.bin"), "config.json"])


# ---------------------------------------------------------------------------------------------- who writes
def test_rank_comes_from_the_launcher_env_without_torch_distributed(rank):
    rank(None)
    assert process_rank() == 0 and is_main_process()
    rank(0)
    assert process_rank() == 0 and is_main_process()
    rank(3)
    assert process_rank() == 3 and not is_main_process()
    rank("")  # set but empty
    assert process_rank() == 0 and is_main_process()


@pytest.fixture
def skipped_save_pretrained(monkeypatch):
    """transformers 5.x: ``save_pretrained`` on a torch.distributed rank != 0 (simulated) writes no weights."""
    mixin = pytest.importorskip("transformers.distributed.mixin")
    if not hasattr(mixin, "_is_torch_distributed_initialized") or not hasattr(mixin, "_get_torch_distributed_rank"):
        pytest.skip("this transformers decides the saving rank elsewhere")
    monkeypatch.setattr(mixin, "_is_torch_distributed_initialized", lambda: True)
    monkeypatch.setattr(mixin, "_get_torch_distributed_rank", lambda: 1)


def test_save_trainer_model_fails_loudly_when_save_pretrained_wrote_nothing(tiny_llama, tmp_path,
                                                                           skipped_save_pretrained):
    def trainer(should_save):
        return SimpleNamespace(args=SimpleNamespace(should_save=should_save),
                               save_model=lambda folder: tiny_llama.save_pretrained(folder, is_main_process=True))

    with pytest.raises(RuntimeError, match="model.safetensors") as err:
        save_trainer_model(trainer(True), str(tmp_path / "model"), "the arm's model")
    assert "the arm's model" in str(err.value) and "config.json" in str(err.value)
    save_trainer_model(trainer(False), str(tmp_path / "other"))  # not the writing process: nothing to check


def test_save_trainer_model_passes_on_a_real_save(tiny_llama, tmp_path):
    trainer = SimpleNamespace(args=SimpleNamespace(should_save=True), save_model=tiny_llama.save_pretrained)
    save_trainer_model(trainer, str(tmp_path / "model"))
    assert (tmp_path / "model" / "model.safetensors").stat().st_size > 0


# ---------------------------------------------------------------------------------------------- worker paths
@pytest.fixture(scope="module")
def seq():
    with example_script("studies/sequential_recipes.py", "sequential_recipes_files") as module:
        yield module


@pytest.fixture(scope="module")
def levers():
    with example_script("studies/tune_es_levers.py", "tune_es_levers_files") as module:
        yield module


@pytest.mark.parametrize("writer_rank", [0, 1])
def test_evaluation_worker_writes_its_result_on_rank_0_only(seq, tiny_model_dir, tmp_path, monkeypatch, rank,
                                                           writer_rank):
    import trl_es.analysis

    monkeypatch.setattr(trl_es.analysis, "evaluate_policy", lambda *a, **k: {"accuracy_greedy": 0.5})
    args = seq.SequentialArguments(model_name_or_path=tiny_model_dir, num_train_prompts=2, num_validation_prompts=0,
                                   num_test_prompts=2, num_kl_prompts=0, num_samples=1, pass_k=[1],
                                   eval_max_new_tokens=2)
    import dataclasses

    spec = {"kind": "evaluate", "arm": "base", "model": tiny_model_dir, "args": dataclasses.asdict(args),
            "result": str(tmp_path / "evaluation.json")}
    rank(writer_rank)
    result = seq.evaluate_arm(spec)
    assert result["accuracy_greedy"] == 0.5
    if writer_rank == 0:
        assert json.loads((tmp_path / "evaluation.json").read_text()) == json.loads(json.dumps(result))
    assert os.listdir(tmp_path) == (["evaluation.json"] if writer_rank == 0 else [])


@pytest.mark.parametrize("writer_rank", [0, 1])
def test_levers_summary_is_written_by_the_main_process_only(levers, tmp_path, rank, writer_rank):
    arm = tmp_path / "seed1" / "base"
    arm.mkdir(parents=True)
    (arm / "results.json").write_text(json.dumps({"curve": [{"step": 2, "accuracy": 0.25}], "accuracy_after": 0.5,
                                                  "iterations": 2, "train_seconds": 1.0}))
    rank(writer_rank)
    table = levers.summarize(str(tmp_path))
    assert table["base"]["seed1"]["final"] == 0.5
    written = sorted(p for p in os.listdir(tmp_path) if p.startswith("levers"))
    assert written == (["levers.json", "levers.md"] if writer_rank == 0 else [])
    if writer_rank == 0:
        assert json.loads((tmp_path / "levers.json").read_text()) == table
        assert "| base | 1 | 2 | 2: 0.250 | 0.500 |" in (tmp_path / "levers.md").read_text()


def test_analyze_writes_its_report_on_the_main_process_only(tiny_llama, tokenizer, tmp_path, monkeypatch):
    import copy

    from trl_es.analysis import analyze

    tuned = copy.deepcopy(tiny_llama)
    for p in tuned.parameters():
        p.data.add_(0.01)
    kwargs = dict(tokenizer=tokenizer, prompts=["hello world"], max_new_tokens=2, taus=(0.0,), ts=(0.0, 1.0))
    monkeypatch.setattr(files, "process_rank", lambda: 1)
    report = analyze(tiny_llama, tuned, **kwargs, output_dir=tmp_path / "rank1")
    assert not (tmp_path / "rank1").exists() and report["plots"]
    monkeypatch.setattr(files, "process_rank", lambda: 0)
    report = analyze(tiny_llama, tuned, **kwargs, output_dir=tmp_path / "rank0")
    assert sorted(os.listdir(tmp_path / "rank0")) == sorted(["report.json", *report["plots"]])
