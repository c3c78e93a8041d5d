"""Run a short ESTrainer job in one of the multi-process modes; used by ``tests/trainer/test_distributed.py``.

Launch it with ``python`` (one process), ``torchrun --nproc_per_node 2`` (population parallelism) or
``deepspeed --num_gpus 2`` (``--mode zero2`` / ``--mode zero3``). It writes into ``--out``:

- ``result.json`` (process 0): the log history, the evaluation metrics, the class of the prepared model, whether
  every process held bitwise identical weights after every iteration, and ``comm/bytes`` per iteration
  (``comm_bytes_per_process``: every process's, with its rank and node);
- the seed log (``es_seed_log.jsonl``) and the trained model (``model/``, loadable with ``from_pretrained``);
- with ``--save_steps k``, Trainer checkpoints every ``k`` iterations (``checkpoint-k/``); ``--resume_from`` resumes
  from one;
- with ``--auto_resume`` and ``--kill_at_step`` / ``--kill_in_save_at_step`` (``tests/trainer/test_preemption.py``, under
  ``torchrun --max-restarts 1``): one process SIGKILLs itself on the first attempt, and the restarted job resumes
  from the newest complete checkpoint (``resume_from_checkpoint="latest"``); ``result.json`` then also says which
  attempt wrote it (``restart_count``) and which checkpoint folders it found (``checkpoints_at_start``).

The data, reward and hyperparameters are fixed here, so every mode must end with the same weights.

On CPU, DeepSpeed goes through accelerate only if the process group is set up first: accelerate's ``PartialState``
picks no backend for DeepSpeed without a GPU, so this script creates it with ``backend="gloo"`` and passes
``accelerator_config={"use_configured_state": True}`` (not needed on GPUs). With ``--dtype bfloat16`` under ZeRO-3,
DeepSpeed's bf16 must be on (``zero.Init`` would cast the weights to fp32 otherwise), which ``transformers`` only
accepts with ``bf16=True``, which it refuses on CPU without ``use_cpu``: the script drops that config-consistency
complaint (``hf_deepspeed_config.mismatches``), a CPU-only shortcut.
"""

import argparse
import json
import os
import random
import sys

import torch

MODES = ("plain", "zero2", "zero3")


def parse_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=MODES, default="plain")
    parser.add_argument("--model", required=True, help="A saved causal LM folder with its tokenizer.")
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--population", type=int, default=4)
    parser.add_argument("--save_steps", type=int, default=0, help="0: no checkpoints.")
    parser.add_argument("--eval_size", type=int, default=9, help="Evaluation prompts (9: uneven over 2 processes).")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--skew_rank", type=int, default=-1,
                        help="Plain mode: this process starts from different weights (ESTrainer must broadcast).")
    parser.add_argument("--resume_from", default=None, help="A checkpoint folder to resume from.")
    parser.add_argument("--lean", action="store_true", help="lean_memory=True (docs/scaling.md).")
    parser.add_argument("--backend", choices=("sequential", "batched_lowrank"), default="sequential",
                        help="population_backend (batched_lowrank: no master copy of fp32 weights).")
    parser.add_argument("--iterable", action="store_true",
                        help="Train on the prompts as a datasets.IterableDataset (a stream) instead of a Dataset.")
    parser.add_argument("--iterable_shards", type=int, default=1,
                        help="With --iterable: the stream's number of shards (as data files of a streamed dataset).")
    parser.add_argument("--sigma", type=float, default=0.02, help="sigma (and learning_rate).")
    parser.add_argument("--vllm", action="store_true",
                        help="use_vllm=True: generate with a colocated vLLM engine per process (needs vLLM and a "
                             "model vLLM's CPU attention runs, e.g. tests/tiny.py build_vllm_llama).")
    parser.add_argument("--vllm_servers", nargs="+", default=None,
                        help="use_vllm=True, vllm_mode='server': one ES vLLM server URL per process.")
    parser.add_argument("--log_completions", action="store_true", help="log_completions=True (parquet tables).")
    parser.add_argument("--environment", action="store_true",
                        help="environment_factory=StartEnvironment (a random start in reset, get_reward) on "
                             "conversational prompts (tests/trainer/test_agents.py's W=2 case).")
    # Preemption (tests/trainer/test_preemption.py): SIGKILL one process on the first attempt of a torchrun --max-restarts
    # job (TORCHELASTIC_RESTART_COUNT == 0), and resume by itself (resume_from_checkpoint="latest").
    parser.add_argument("--kill_at_step", type=int, default=0,
                        help="SIGKILL --kill_rank in the middle of this iteration (at its 2nd reward call: after one "
                             "of its members was scored), on the first attempt only. 0: never.")
    parser.add_argument("--kill_in_save_at_step", type=int, default=0,
                        help="SIGKILL --kill_rank while it writes checkpoint-K: after save_model (model, seed log, ES "
                             "state) and before the scheduler, RNG and trainer_state.json; first attempt only.")
    parser.add_argument("--kill_rank", type=int, default=0, help="The process that --kill_* kills.")
    parser.add_argument("--auto_resume", action="store_true",
                        help='resume_from_checkpoint="latest" in ESConfig: resume from the newest complete checkpoint.')
    parser.add_argument("--plain_config", action="store_true",
                        help="Several processes without use_cpu=True: ESConfig must find the launcher's world itself "
                             "(tests/trainer/test_launch_world.py).")
    parser.add_argument("--stability", action="store_true",
                        help="sigma='auto' (sigma_adapt_steps 2, sigma_calibration_prompts 8) and collapse_guard=True "
                             "(patience 1), with a made-up collapse: the reward drops by 1 from iteration 3 on "
                             "(tests/trainer/test_stability.py).")
    parser.add_argument("--calibration_prompts", type=int, default=8,
                        help="--stability: sigma_calibration_prompts (the batch of 4 and 4 drawn; 0: the batch alone).")
    parser.add_argument("--qlora", action="store_true",
                        help="A 4-bit NF4 base (bitsandbytes) with a LoRA adapter on q_proj/v_proj (issue 60).")
    parser.add_argument("--local_rank", type=int, default=-1)  # the deepspeed launcher passes it
    return parser.parse_args()


#: The prompt batch of every reward call in training (each member's call), in order.
PROMPTS_SEEN: list[list[str]] = []

#: --stability: the first iteration whose rewards drop by 1 (a made-up collapse); 0: none.
COLLAPSE_AT: dict = {"step": 0}

#: Set by main() from --kill_at_step, --kill_in_save_at_step, --kill_rank, --auto_resume; "calls" counts this
#: process's reward calls per iteration.
PREEMPTION: dict = {"calls": {}}


def _armed() -> bool:
    """Whether this process is the one to kill: --kill_rank, on a torchrun job's first attempt."""
    return (int(os.environ.get("RANK", "0")) == PREEMPTION.get("kill_rank", 0)
            and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0")


def _kill() -> None:
    import signal

    sys.stdout.flush()
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def _maybe_kill_in_reward(trainer_state) -> None:
    """--kill_at_step K: SIGKILL on this process's 2nd reward call of iteration K (one of its members scored)."""
    step = PREEMPTION.get("kill_at_step")
    if not step or trainer_state is None or not _armed():
        return
    current = trainer_state.global_step + 1
    calls = PREEMPTION["calls"]
    calls[current] = calls.get(current, 0) + 1
    if current == step and calls[current] == 2:
        _kill()


def _arm_kill_in_save(trainer) -> None:
    """--kill_in_save_at_step K: SIGKILL once save_model has written checkpoint-K's model, seed log and ES state,
    before Trainer._save_checkpoint writes the scheduler, RNG state and trainer_state.json (a partial folder)."""
    step = PREEMPTION.get("kill_in_save_at_step")
    if not step or not _armed():
        return
    save_model = trainer.save_model

    def save_then_kill(output_dir=None, _internal_call=False):
        save_model(output_dir, _internal_call)
        if _internal_call and trainer.state.global_step == step:
            _kill()

    trainer.save_model = save_then_kill


def _checkpoints_on_disk(out: str) -> dict:
    """The checkpoint-* folders of ``out`` and their files (what a restarted attempt starts from)."""
    if not os.path.isdir(out):
        return {}
    return {name: sorted(os.listdir(os.path.join(out, name))) for name in sorted(os.listdir(out))
            if name.startswith("checkpoint-") and os.path.isdir(os.path.join(out, name))}


def mean_code(completions, prompts=None, **kwargs):
    """Mean character code / 128: differs between almost any two completions. Records the prompts it was called on."""
    if prompts is not None:
        PROMPTS_SEEN.append(list(dict.fromkeys(prompts)))
    _maybe_kill_in_reward(kwargs.get("trainer_state"))
    state = kwargs.get("trainer_state")
    drop = 1.0 if COLLAPSE_AT["step"] and state is not None and state.global_step + 1 >= COLLAPSE_AT["step"] else 0.0
    return [sum(map(ord, c)) / (128 * max(1, len(c))) - drop for c in completions]


class StartEnvironment:
    """An environment whose reset draws its task from `random` (common random numbers keep it member-independent)."""

    def reset(self, **kwargs):
        self.start = random.randint(0, 9)
        return f" from {self.start}"

    def get_reward(self) -> float:
        return self.start / 10


def mean_code_messages(completions, environments, **kwargs):
    """mean_code of the assistant's text, plus the environment's task: a reward that reads the environment."""
    return [m + e.start for m, e in zip(mean_code([c[0]["content"] for c in completions]), environments,
                                        strict=True)]


def run(mode: str, model: str, out: str, steps: int = 2, population: int = 4, save_steps: int = 0,
        eval_size: int = 9, skew_rank: int = -1, dtype: str = "float32", resume_from: str | None = None,
        lean: bool = False, backend: str = "sequential", iterable: bool = False, iterable_shards: int = 1,
        vllm: bool = False, sigma: float = 0.02, log_completions: bool = False, plain_config: bool = False,
        environment: bool = False, vllm_servers: list[str] | None = None, stability: bool = False,
        qlora: bool = False, calibration_prompts: int = 8) -> dict:
    """Train, evaluate and save; returns (and writes, on process 0) the ``result.json`` content."""
    extra = {}
    if mode in ("zero2", "zero3"):
        import deepspeed
        from accelerate import PartialState

        deepspeed.init_distributed(dist_backend="gloo")
        os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
        PartialState(backend="gloo")
        stage = 3 if mode == "zero3" else 2
        extra = {
            "deepspeed": {
                "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 100},
                "bf16": {"enabled": dtype == "bfloat16" and stage == 3},
                "train_micro_batch_size_per_gpu": "auto",
                "train_batch_size": "auto",
                "gradient_accumulation_steps": "auto",
            },
            "accelerator_config": {"use_configured_state": True},
        }
    elif int(os.environ.get("WORLD_SIZE", "1")) > 1 and not plain_config:
        extra = {"use_cpu": True}  # accelerate: several CPU processes (gloo)

    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback

    from trl_es import ESConfig, ESTrainer
    from trl_es.fingerprint import tensors_fingerprint
    from trl_es.trainer.distributed import fingerprints_agree

    extra["population_backend"] = backend
    if vllm:
        extra.update(use_vllm=True, vllm_kv_cache_memory_bytes=1 << 26)
    if vllm_servers:
        extra.update(use_vllm=True, vllm_mode="server", vllm_server_base_urls=list(vllm_servers))
    if lean:
        extra["lean_memory"] = True
    if log_completions:
        extra["log_completions"] = True
    if save_steps:
        extra.update(save_strategy="steps", save_steps=save_steps)
    else:
        extra.update(save_strategy="no")
    if PREEMPTION.get("auto_resume"):
        extra["resume_from_checkpoint"] = "latest"
    COLLAPSE_AT["step"] = 3 if stability else 0
    if stability:
        extra.update(collapse_guard=True, collapse_guard_patience=1, sigma_adapt_steps=2,
                     sigma_calibration_prompts=calibration_prompts)
    config = ESConfig(
        output_dir=out,
        max_steps=steps,
        population_size=population,
        prompt_batch_size=4,
        max_completion_length=6,
        sigma="auto" if stability else sigma,
        learning_rate=sigma,
        report_to=[],
        noise_table_size=1 << 20,
        disable_tqdm=True,
        seed=0,
        model_init_kwargs={"dtype": dtype},
        **extra,
    )
    if mode == "zero3" and dtype == "bfloat16":
        config.hf_deepspeed_config.mismatches = []  # CPU only: see the module docstring
    tokenizer = AutoTokenizer.from_pretrained(model)
    train = Dataset.from_dict({"prompt": [f"Write: {i}" for i in range(8)]})
    if iterable:
        train = train.to_iterable_dataset(num_shards=iterable_shards)
    evaluation = Dataset.from_dict({"prompt": [f"Say: {i}" for i in range(eval_size)]})

    checks, steps_run = [], []

    class ReplicaCheck(TrainerCallback):
        """After every iteration: do all processes hold bitwise identical model weights and masters?"""

        def on_step_end(self, targs, state, control, **kwargs):
            steps_run.append(state.global_step)
            if trainer.sharded or not torch.distributed.is_initialized():
                return
            model = trainer.accelerator.unwrap_model(trainer.model)
            tensors = list(model.state_dict().values()) + list(trainer.es_params.master_state_dict().values())
            checks.append(fingerprints_agree(tensors_fingerprint(tensors, digest_size=16))[0])

    model_or_path = model
    if skew_rank >= 0 and int(os.environ.get("RANK", "0")) == skew_rank:
        from transformers import AutoModelForCausalLM

        model_or_path = AutoModelForCausalLM.from_pretrained(model, dtype=dtype)
        with torch.no_grad():
            model_or_path.model.norm.weight.add_(1.0)
    agents = {}
    if environment:
        train = Dataset.from_dict({"prompt": [[{"role": "user", "content": f"Write: {i}"}] for i in range(8)]})
        evaluation = Dataset.from_dict({"prompt": [[{"role": "user", "content": f"Say: {i}"}]
                                                   for i in range(eval_size)]})
        agents = {"environment_factory": StartEnvironment}
    reward = mean_code_messages if environment else mean_code
    if qlora:  # a frozen 4-bit base, ES over the fp32 LoRA adapter
        from peft import LoraConfig
        from transformers import BitsAndBytesConfig

        agents.update(quantization_config=BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                                             bnb_4bit_compute_dtype=torch.float32),
                      peft_config=LoraConfig(target_modules=["q_proj", "v_proj"], init_lora_weights=False, r=4))
    trainer = ESTrainer(model_or_path, reward, args=config, train_dataset=train, eval_dataset=evaluation,
                        processing_class=tokenizer, callbacks=[ReplicaCheck()], **agents)
    PROMPTS_SEEN.clear()  # (a previous run in this process scored its evaluation prompts)
    _arm_kill_in_save(trainer)
    checkpoints_at_start = _checkpoints_on_disk(out)
    trainer.train(resume_from_checkpoint=resume_from)
    # The distinct prompt batches the training iterations scored on (one per iteration: all members share it).
    batches = [b for i, b in enumerate(PROMPTS_SEEN) if i == 0 or b != PROMPTS_SEEN[i - 1]]
    PROMPTS_SEEN.clear()
    if torch.distributed.is_initialized() and not trainer.sharded:
        every = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(every, batches)
    else:
        every = [batches]
    # Every process's comm/bytes per iteration and its node (GROUP_RANK: torchrun, CROSS_RANK: deepspeed), gathered
    # after training.
    node = os.environ.get("GROUP_RANK", os.environ.get("CROSS_RANK", "0"))
    comm = {"rank": int(os.environ.get("RANK", "0")), "node": int(node),
            "comm_bytes": [h["comm/bytes"] for h in trainer.state.log_history if "comm/bytes" in h]}
    every_comm = [comm]
    if torch.distributed.is_initialized():
        every_comm = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(every_comm, comm)
    metrics = trainer.evaluate()
    trainer.save_model(os.path.join(out, "model"))
    result = {}
    if trainer.accelerator.is_main_process:
        result = {
            "world_size": trainer.accelerator.num_processes,
            "args_world_size": config.world_size,
            "use_cpu": config.use_cpu,
            "sharded": trainer.sharded,
            "model_wrapped": type(trainer.model_wrapped).__name__,
            "replicas_identical": checks,
            "prompt_batches": batches,
            "prompt_batches_identical": all(b == batches for b in every),
            "steps_run": steps_run,
            "restart_count": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
            "checkpoints_at_start": checkpoints_at_start,
            "log_history": trainer.state.log_history,
            "eval": metrics,
            "comm_bytes": [h["comm/bytes"] for h in trainer.state.log_history if "comm/bytes" in h],
            "comm_bytes_per_process": every_comm,
        }
        with open(os.path.join(out, "result.json"), "w") as f:
            json.dump(result, f)
    return result


def main():
    args = parse_args()
    PREEMPTION.update(kill_at_step=args.kill_at_step, kill_in_save_at_step=args.kill_in_save_at_step,
                      kill_rank=args.kill_rank, auto_resume=args.auto_resume)
    run(args.mode, args.model, args.out, args.steps, args.population, args.save_steps, args.eval_size,
        args.skew_rank, args.dtype, args.resume_from, args.lean, args.backend, args.iterable, args.iterable_shards,
        args.vllm, args.sigma, args.log_completions, args.plain_config, args.environment, args.vllm_servers,
        args.stability, args.qlora, args.calibration_prompts)
    # Leave together, then skip the interpreter's teardown: on a loaded machine the C++ destructors of the gloo /
    # DeepSpeed threads sometimes abort at exit ("terminate called without an active exception", SIGABRT) after all
    # the work is done and written, which would fail the launch.
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
