"""Multi-process ES on CPU (gloo): population parallelism and DeepSpeed ZeRO-2/3 end bitwise where one process ends.

Every test launches ``tests/distributed/run_es.py`` (2 iterations of a tiny Llama, population 4, 4 prompts, greedy
decoding) with two processes and compares with the same job run in this process (one process, one thread):
population parallelism (``torchrun``'s two processes, forked from the warm interpreter: :func:`torchrun`) and ZeRO-2
in fp32, ZeRO-3 with a bf16 model and fp32 master shards (the ``deepspeed`` launcher, and torchrun's processes).
"""

import json
import os
import pickle
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from trl_es import replay
from paths import TESTS

HERE = TESTS
SCRIPT = os.path.join(HERE, "distributed", "run_es.py")
sys.path.insert(0, os.path.join(HERE, "distributed"))

import run_es

from trl_es.trainer.distributed import es_deepspeed_config, zero3_partition

# population x (sum, count, completions, tokens, per-function sum and count, invalid, successes) fp64, and TRL's
# completion statistics (6 sums, a per-function square sum, 6 length extremes per share; one share here)
STATS_BYTES = 4 * (6 + 2 * 1) * 8 + 4 * (6 + 1 + 6 * 1) * 8


def launch(launcher: list[str], out, model_dir, *extra, timeout=600):
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    cmd = [*launcher, SCRIPT, "--model", model_dir, "--out", str(out), *extra]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    with open(os.path.join(out, "result.json")) as f:
        return json.load(f)


WARM = None  # the worker's warm interpreter (conftest.warm_python) while a module that uses warm_ranks runs


@pytest.fixture(scope="module")
def warm_ranks(warm_python):
    """For a module's tests (``pytestmark = pytest.mark.usefixtures("warm_ranks")``): :func:`torchrun` forks its two
    processes from the warm interpreter."""
    global WARM
    WARM = warm_python
    yield
    WARM = None


pytestmark = pytest.mark.usefixtures("warm_ranks")


def torchrun(out, model_dir, *extra, timeout=600, warm=None):
    """The job as ``torchrun --nproc_per_node 2`` runs it. With a warm interpreter (``warm``, or this module's
    :func:`warm_ranks`): two processes with the variables torchrun gives its workers (rank, world, master address
    and port), forked from it (~13 CPU-s of imports less per run; the launchers themselves run in
    test_launch_world.py, test_preemption.py and test_multinode.py); without one (the vLLM lane) torchrun itself."""
    warm = warm or WARM
    if warm is None:
        return launch([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                       "--master_port", str(29600 + os.getpid() % 300)], out, model_dir, *extra, timeout=timeout)
    argv = [SCRIPT, "--model", model_dir, "--out", str(out), *extra]
    procs = warm.run_ranks(argv, os.getcwd(), 2, env={"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"},
                           timeout=timeout)
    for rank, proc in enumerate(procs):
        assert proc.returncode == 0, f"rank {rank} of {argv} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    with open(os.path.join(out, "result.json")) as f:
        return json.load(f)


# the deepspeed launcher (docs/scaling.md), for the ZeRO-3 run the other ZeRO tests compare with; they use torchrun's
# variables
def deepspeed(out, model_dir, *extra):
    return launch(["deepspeed", "--num_gpus", "2", "--master_port", str(29900 + os.getpid() % 300)],
                  out, model_dir, *extra)


def weights(path):
    model = AutoModelForCausalLM.from_pretrained(path, dtype="auto")
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_bitwise(a, b):
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


def seed_log(path):
    with open(os.path.join(path, "es_seed_log.jsonl")) as f:
        return [json.loads(line) for line in f]


def run_here(out, model_dir, **kwargs):
    """The job in this process, with one thread as each launched process."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return out, run_es.run("plain", model_dir, str(out), **kwargs)
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, tiny_model_dir):
    return run_here(tmp_path_factory.mktemp("single"), tiny_model_dir)


@pytest.fixture(scope="module")
def reference_bf16(tmp_path_factory, tiny_model_dir):
    return run_here(tmp_path_factory.mktemp("single-bf16"), tiny_model_dir, dtype="bfloat16", save_steps=2)


def reassemble(folder, kind, world=2):
    """Whole flat tensors from the per-process ZeRO-3 shards ``{kind}.rank{r}-of-{W}.safetensors``."""
    full = {}
    for rank in range(world):
        with safe_open(os.path.join(folder, f"{kind}.rank{rank:05d}-of-{world:05d}.safetensors"), "pt") as f:
            metadata = f.metadata()
            for name in f.keys():  # noqa: SIM118
                start, length, numel = map(int, metadata[name].split(","))
                tensor = f.get_tensor(name)
                assert tensor.numel() == length
                full.setdefault(name, torch.full((numel,), float("nan")))[start : start + length] = tensor
    return full


@pytest.mark.distributed
def test_reference_trains(reference, tiny_model_dir):
    out, result = reference
    assert result["world_size"] == 1 and result["comm_bytes"] == [0.0, 0.0]
    base, trained = weights(tiny_model_dir), weights(out / "model")
    assert any(not torch.equal(base[k], trained[k]) for k in base)


@pytest.mark.distributed
def test_population_parallelism_matches_one_process(reference, tmp_path, tiny_model_dir):
    """Process 1 starts from different weights: ESTrainer finds out (fingerprints) and broadcasts process 0's."""
    ref_out, ref = reference
    result = torchrun(tmp_path, tiny_model_dir, "--skew_rank", "1")
    assert result["world_size"] == 2 and not result["sharded"]
    assert result["model_wrapped"] == "LlamaForCausalLM"  # not DistributedDataParallel
    assert result["replicas_identical"] == [True, True]  # after each iteration, on every process
    assert_bitwise(weights(tmp_path / "model"), weights(ref_out / "model"))
    assert seed_log(tmp_path) == seed_log(ref_out)
    assert result["eval"]["eval_reward"] == ref["eval"]["eval_reward"]
    train_logs = [h for h in result["log_history"] if "reward" in h]
    ref_logs = [h for h in ref["log_history"] if "reward" in h]
    for key in ("reward", "reward_std", "rewards/mean_code/mean", "completion_tokens"):
        assert [h[key] for h in train_logs] == [h[key] for h in ref_logs], key
    # Bytes into each process: 2 prompt rows pickled per process (all the same size here) gathered with their
    # int64 sizes, the per-member statistics; on the first iteration also the 16-byte weight fingerprints and the
    # broadcast of process 0's parameters, buffers and fp32 master (2 copies of the parameters; every process then
    # rebuilds the anchor theta_0 from the broadcast weights).
    rows = len(pickle.dumps([{"prompt": "Write: 0"}, {"prompt": "Write: 1"}]))
    per_iteration = 2 * 8 + 2 * rows + STATS_BYTES
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    broadcast = sum(2 * p.numel() * 4 for p in model.parameters()) + sum(b.numel() * 4 for b in model.buffers())
    assert result["comm_bytes"] == [per_iteration + 2 * 16 + broadcast, per_iteration]
    # The seed log, written by process 0, replays to the trained weights.
    rebuilt = replay(AutoModelForCausalLM.from_pretrained(tiny_model_dir), str(tmp_path))
    assert_bitwise({k: v for k, v in rebuilt.state_dict().items()}, weights(tmp_path / "model"))


@pytest.mark.distributed
def test_environments_population_parallelism_matches_one_process(tmp_path, tiny_model_dir):
    """environment_factory (a reset drawing its task from `random`, get_reward as a reward): the members of process 1
    get the same tasks as in one process (common random numbers), so 2 processes end bitwise where one ends."""
    ref_out, ref = run_here(tmp_path / "one", tiny_model_dir, environment=True)
    result = torchrun(tmp_path / "two", tiny_model_dir, "--environment")
    assert result["world_size"] == 2 and result["replicas_identical"] == [True, True]
    base, trained = weights(tiny_model_dir), weights(tmp_path / "two" / "model")
    assert any(not torch.equal(base[k], trained[k]) for k in base)
    assert_bitwise(trained, weights(ref_out / "model"))
    assert seed_log(tmp_path / "two") == seed_log(ref_out)
    assert result["eval"]["eval_rewards/StartEnvironment/mean"] == ref["eval"]["eval_rewards/StartEnvironment/mean"]


@pytest.mark.distributed
def test_lean_mode_population_parallelism_matches_one_process_and_replays(tmp_path, tiny_model_dir):
    """The lean mode (lean_memory, batched low-rank members, no master copy of the fp32 weights, fresh Gaussian
    noise instead of the table): 2 processes end bitwise where one ends, and the seed log replays it."""
    single_out, single = run_here(tmp_path / "single", tiny_model_dir, lean=True, backend="batched_lowrank")
    result = torchrun(tmp_path / "two", tiny_model_dir, "--lean", "--backend", "batched_lowrank")
    assert result["world_size"] == 2 and single["world_size"] == 1
    trained = weights(tmp_path / "two" / "model")
    assert_bitwise(trained, weights(single_out / "model"))
    assert any(not torch.equal(trained[k], v) for k, v in weights(tiny_model_dir).items())
    assert seed_log(tmp_path / "two") == seed_log(single_out)
    assert seed_log(single_out)[0]["perturbation"]["type"] == "lowrank"
    rebuilt = replay(AutoModelForCausalLM.from_pretrained(tiny_model_dir), str(tmp_path / "two"))
    assert_bitwise(dict(rebuilt.state_dict()), trained)


@pytest.mark.distributed
@pytest.mark.parametrize("backend", ["sequential", "batched_lowrank"])
def test_qlora_population_parallelism_matches_one_process_and_replays(tmp_path, tokenizer, backend):
    """ES on a 4-bit NF4 base (issue 60): 2 processes end on the one-process adapter, bitwise, with identical replicas
    at every step, and the seed log (which records the quantization config) replays it."""
    pytest.importorskip("bitsandbytes")
    from peft import LoraConfig, get_peft_model
    from tiny import build_vllm_llama
    from transformers import BitsAndBytesConfig, set_seed

    model_dir = tmp_path / "base64"  # hidden size 64: whole blocks of bitsandbytes' CPU 4-bit kernel
    build_vllm_llama(tokenizer).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    single_out, single = run_here(tmp_path / "single", str(model_dir), qlora=True, backend=backend)
    result = torchrun(tmp_path / "two", str(model_dir), "--qlora", "--backend", backend)
    assert result["world_size"] == 2 and all(result["replicas_identical"])
    trained = load_file(str(tmp_path / "two" / "model" / "adapter_model.safetensors"))
    assert_bitwise(trained, load_file(str(single_out / "model" / "adapter_model.safetensors")))
    assert seed_log(tmp_path / "two") == seed_log(single_out)
    assert seed_log(single_out)[0]["quantization_config"]["bnb_4bit_quant_type"] == "nf4"
    set_seed(0)
    base = AutoModelForCausalLM.from_pretrained(model_dir, quantization_config=BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32))
    initial = get_peft_model(base, LoraConfig(target_modules=["q_proj", "v_proj"], init_lora_weights=False, r=4))
    rebuilt = replay(initial, str(tmp_path / "two"))
    ours = {k.replace(".default", ""): v for k, v in rebuilt.state_dict().items() if "lora_" in k}
    assert_bitwise(ours, trained)


@pytest.mark.distributed
def test_lean_mode_zero3_matches_one_process(tmp_path, tiny_model_dir):
    """lean_memory under ZeRO-3 (bf16 model, fp32 master shards, fresh Gaussian noise): the one-process weights."""
    single_out, _ = run_here(tmp_path / "single", tiny_model_dir, dtype="bfloat16", lean=True)
    result = torchrun(tmp_path / "zero3", tiny_model_dir, "--mode", "zero3", "--dtype", "bfloat16", "--lean")
    assert result["sharded"]
    assert_bitwise(weights(tmp_path / "zero3" / "model"), weights(single_out / "model"))
    assert seed_log(tmp_path / "zero3") == seed_log(single_out)


@pytest.fixture(scope="module")
def zero3_run(tmp_path_factory, tiny_model_dir):
    """A bf16 model partitioned over 2 processes (loaded under zero.Init), fp32 master partitions, a checkpoint after
    each of the 2 iterations."""
    out = tmp_path_factory.mktemp("zero3")
    return out, deepspeed(out, tiny_model_dir, "--mode", "zero3", "--save_steps", "1", "--dtype", "bfloat16")


@pytest.mark.distributed
def test_zero3_matches_one_process(reference_bf16, zero3_run):
    """Every member scored by both processes together, each on 2 of the 4 prompts."""
    ref_out, ref = reference_bf16
    out, result = zero3_run
    assert result["world_size"] == 2 and result["sharded"]
    assert result["model_wrapped"] == "DeepSpeedEngine"
    trained = weights(out / "model")  # gathered by Trainer.save_model
    assert {v.dtype for v in trained.values()} == {torch.bfloat16}
    assert_bitwise(trained, weights(ref_out / "model"))
    assert_bitwise(weights(out / "checkpoint-2"), trained)
    assert seed_log(out) == seed_log(ref_out)
    assert seed_log(out / "checkpoint-2") == seed_log(ref_out)
    # The fp32 master and the anchor (theta_0, in the model's dtype), saved as one shard per process, are the
    # one-process tensors.
    for kind, dtype in (("es_master", torch.float32), ("es_anchor", torch.bfloat16)):
        single = load_file(ref_out / "checkpoint-2" / f"{kind}.safetensors")
        sharded = reassemble(out / "checkpoint-2", kind)
        assert single.keys() == sharded.keys()
        for name, tensor in single.items():
            assert tensor.dtype == dtype and torch.equal(sharded[name].to(dtype), tensor.reshape(-1)), (kind, name)
    assert result["eval"]["eval_reward"] == ref["eval"]["eval_reward"]  # 9 prompts: 5 on process 0, 4 on 1
    gathered = [h["comm/param_gather_bytes"] for h in result["log_history"] if "comm/param_gather_bytes" in h]
    assert len(gathered) == 2 and all(g > 0 for g in gathered)


@pytest.mark.distributed
def test_zero3_resume_equals_uninterrupted(zero3_run, tmp_path, tiny_model_dir):
    """Interrupted after iteration 1 and resumed under ZeRO-3 with the same 2 processes: the same weights, masters,
    anchor and seed log as the uninterrupted run, bitwise."""
    out, _ = zero3_run
    resumed_out = tmp_path / "resumed"
    result = torchrun(resumed_out, tiny_model_dir, "--mode", "zero3", "--save_steps", "1", "--dtype", "bfloat16",
                      "--resume_from", str(out / "checkpoint-1"))  # the deepspeed launcher saved it: any launcher resumes
    assert result["steps_run"] == [2]  # only iteration 2 ran in this launch
    assert_bitwise(weights(resumed_out / "model"), weights(out / "model"))
    assert seed_log(resumed_out) == seed_log(out)
    for kind in ("es_master", "es_anchor"):
        full, again = reassemble(out / "checkpoint-2", kind), reassemble(resumed_out / "checkpoint-2", kind)
        assert all(torch.equal(full[n], again[n]) for n in full), kind


@pytest.mark.distributed
def test_zero3_checkpoint_resumes_in_one_process(zero3_run, tmp_path, tiny_model_dir):
    """The ZeRO-3 checkpoint's fp32 master lives in 2 per-process shards; one process reassembles its elements (all of
    them) and ends bitwise where the uninterrupted 2-process run ends."""
    out, _ = zero3_run
    _, result = run_here(tmp_path, tiny_model_dir, dtype="bfloat16", resume_from=str(out / "checkpoint-1"))
    assert result["steps_run"] == [2]
    assert_bitwise(weights(tmp_path / "model"), weights(out / "model"))
    assert seed_log(tmp_path) == seed_log(out)


def test_read_flat_ranges_from_any_number_of_shards(tmp_path):
    """Master/anchor shards written by W processes are read back by a process of any other partitioning."""
    from safetensors.torch import save_file

    from trl_es.trainer.distributed import read_flat_ranges

    full = {"a": torch.arange(10, dtype=torch.float32), "b": torch.arange(7, dtype=torch.float32) + 100}
    for world in (2, 3):
        folder = tmp_path / f"w{world}"
        folder.mkdir()
        for rank in range(world):
            tensors, metadata = {}, {}
            for name, t in full.items():
                size = -(-t.numel() // world)
                start = min(rank * size, t.numel())
                length = max(0, min(size, t.numel() - start))
                tensors[name] = t[start : start + length].clone()
                metadata[name] = f"{start},{length},{t.numel()}"
            save_file(tensors, folder / f"es_master.rank{rank:05d}-of-{world:05d}.safetensors", metadata)
        for layout in ({"a": (0, 10), "b": (0, 7)}, {"a": (3, 4), "b": (5, 2)}):
            got = read_flat_ranges(str(folder), "es_master.safetensors", layout)
            for name, (start, length) in layout.items():
                assert torch.equal(got[name], full[name][start : start + length]), (world, name)
    (tmp_path / "w2" / "es_master.rank00001-of-00002.safetensors").unlink()
    with pytest.raises(ValueError, match="incomplete"):
        read_flat_ranges(str(tmp_path / "w2"), "es_master.safetensors", {"a": (0, 10)})
    save_file(full, tmp_path / "es_master.safetensors")  # one whole file
    assert torch.equal(read_flat_ranges(str(tmp_path), "es_master.safetensors", {"a": (2, 3)})["a"], full["a"][2:5])
    assert read_flat_ranges(str(tmp_path / "w3"), "es_anchor.safetensors", {"a": (0, 1)}) is None


@pytest.mark.distributed
def test_zero2_runs_as_population_parallelism(reference, tmp_path, tiny_model_dir):
    ref_out, _ = reference
    result = torchrun(tmp_path, tiny_model_dir, "--mode", "zero2")  # DeepSpeed from ESConfig.deepspeed under torchrun
    assert result["model_wrapped"] == "DeepSpeedEngine" and not result["sharded"]
    assert result["replicas_identical"] == [True, True]
    assert_bitwise(weights(tmp_path / "model"), weights(ref_out / "model"))


# ---------------------------------------------------------------------------------------------- no processes
class FakeZero3Param:
    """What zero3_partition reads from a DeepSpeed ZeRO-3 parameter."""

    def __init__(self, numel, partition_size):
        self.ds_id, self.ds_numel = 0, numel
        self.ds_tensor = torch.arange(partition_size, dtype=torch.float32)


@pytest.mark.parametrize(
    "numel, partition, rank, start, real",
    [
        (10, 5, 0, 0, 5),
        (10, 5, 1, 5, 5),
        (9, 5, 1, 5, 4),  # the last partition is padded: 4 real elements
        (3, 2, 1, 2, 1),
        (2, 1, 3, 2, 0),  # rank 3 of 4 for a 2-element tensor: only padding
    ],
)
def test_zero3_partition_keeps_real_elements(numel, partition, rank, start, real):
    param = FakeZero3Param(numel, partition)
    local, whole, first = zero3_partition(param, rank=rank)
    assert (whole, first, local.numel()) == (numel, start, real)
    assert local.is_contiguous() and local.untyped_storage().data_ptr() == param.ds_tensor.untyped_storage().data_ptr()
    if real:  # a view of the partition: ES writes it in place
        local.fill_(-1.0)
        assert param.ds_tensor[:real].eq(-1.0).all() and not param.ds_tensor[real:].eq(-1.0).any()


def test_es_deepspeed_config():
    def config(stage):
        return {"zero_optimization": {"stage": stage}, "optimizer": {"type": "AdamW"}, "scheduler": {"type": "WarmupLR"},
                "bf16": {"enabled": True}, "gradient_clipping": 1.0, "train_micro_batch_size_per_gpu": "auto"}

    zero2 = es_deepspeed_config(config(2), micro_batch_size=4, world_size=2)
    assert "optimizer" not in zero2 and "scheduler" not in zero2 and "gradient_clipping" not in zero2
    assert zero2["zero_optimization"]["stage"] == 0 and zero2["bf16"]["enabled"] is False
    assert (zero2["train_micro_batch_size_per_gpu"], zero2["gradient_accumulation_steps"], zero2["train_batch_size"]) == (4, 1, 8)
    zero3 = es_deepspeed_config(config(3), micro_batch_size=2, world_size=4)
    assert zero3["zero_optimization"] == {"stage": 3, "stage3_gather_16bit_weights_on_model_save": True}
    assert zero3["bf16"]["enabled"] is True and "optimizer" not in zero3 and zero3["train_batch_size"] == 8
    explicit = config(3)
    explicit["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = False
    assert es_deepspeed_config(explicit, 1, 1)["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] is False


@pytest.mark.distributed
@pytest.mark.parametrize("shards", [1, 2])
def test_iterable_dataset_population_parallelism_matches_one_process(tmp_path, tiny_model_dir, shards):
    """A streaming (iterable) train dataset: both processes read the stream, each keeps its slice of every batch,
    the slices are gathered: every process scores the same prompts in stream order, and the weights end bitwise as
    with one process. Three iterations over 8 rows in batches of 4 wrap around the stream once. With 2 shards (as a
    streamed dataset of 2 data files) accelerate would split the stream by shard, one per process; it must not."""
    ref_out, ref = run_here(tmp_path / "one", tiny_model_dir, steps=3, iterable=True, iterable_shards=shards)
    result = torchrun(tmp_path / "two", tiny_model_dir, "--iterable", "--iterable_shards", str(shards), "--steps", "3")
    expected = [[f"Write: {i}" for i in range(4)], [f"Write: {i}" for i in range(4, 8)],
                [f"Write: {i}" for i in range(4)]]
    assert ref["prompt_batches"] == expected
    assert result["prompt_batches"] == expected and result["prompt_batches_identical"]
    assert result["replicas_identical"] == [True, True, True]
    assert_bitwise(weights(tmp_path / "two" / "model"), weights(ref_out / "model"))
    assert seed_log(tmp_path / "two") == seed_log(ref_out)
    assert result["eval"]["eval_reward"] == ref["eval"]["eval_reward"]


@pytest.mark.distributed
def test_completion_logs_population_parallelism_match_one_process(tmp_path, tiny_model_dir):
    """log_completions on two processes: process 0 alone writes each iteration's table, whole (no temporary file
    left), and it holds every member's completions, the same table as one process writes."""
    import pandas as pd

    _, one = run_here(tmp_path / "one", tiny_model_dir, log_completions=True)
    torchrun(tmp_path / "two", tiny_model_dir, "--log_completions")
    for step in (1, 2):
        name = f"completions/completions_{step:05d}.parquet"
        a, b = pd.read_parquet(tmp_path / "one" / name), pd.read_parquet(tmp_path / "two" / name)
        assert len(a) == 4 * 4  # population x prompt_batch_size x num_generations
        assert sorted(set(a["member"])) == [0, 1, 2, 3] and set(a["step"]) == {step}
        pd.testing.assert_frame_equal(a, b)
    assert sorted(os.listdir(tmp_path / "two" / "completions")) == ["completions_00001.parquet",
                                                                    "completions_00002.parquet"]
