"""ESTrainer: Evolution Strategies fine-tuning as a TRL trainer (a drop-in for GRPOTrainer)."""

from __future__ import annotations

import math
import os
import re
import textwrap
import time
import warnings
from collections import defaultdict

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    TrainerCallback,
)
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from transformers.utils import logging
from trl.trainer.base_trainer import _BaseTrainer

from ..analysis._common import group_name
from ..analysis.diversity import success_diversity
from ..es.anchor import FileAnchor, MemoryAnchor, checkpoint_files, make_anchor
from ..es.noise import NOISE_BLOCK_SIZE, make_noise_source
from ..es.perturbation import LowRankPerturbation, linear_weight_names
from ..es.population import (
    MemberResult,
    Rollout,
    make_population_backend,
    member_indices,
    member_seed,
    sample_population,
)
from ..es.seedlog import SEED_LOG_NAME, SeedLog
from ..files import SAVED_MODEL_FILES, atomic_path, require_files
from ..es.shaping import shape_fitness
from ..es.update import TrainedParameters, es_gradient_, es_update_, select_parameters
from ..generation import make_engine
from ..models import resolve_model_path
from .distributed import (
    ES_DEEPSPEED_NOTE,
    all_gather_objects,
    broadcast_tensors_,
    es_deepspeed_config,
    es_parameter_entries,
    fingerprint,
    fingerprints_agree,
    is_zero3_param,
    checkpoint_model_files,
    read_flat_ranges,
    release_gathered_,
    tensor_bytes,
)
from .es_config import ESConfig
from .scoring import (
    RewardScorer,
    build_generation_config,
    generate_completions,
    prompt_texts,
    score_model,
    validate_dataset,
)

logger = logging.get_logger(__name__)

MASTER_WEIGHTS_NAME = "es_master.safetensors"
ANCHOR_WEIGHTS_NAME = "es_anchor.safetensors"


def _fitness_of(rewards: torch.Tensor) -> float:
    """Mean of the non-NaN rewards, summed in float64 (NaN if there is none).

    A float64 sum of float32 rewards is exact for any realistic batch, so it does not depend on how the completions
    are split across processes: the sharded (ZeRO-3) fitness, a sum of per-process sums, equals this bitwise.
    """
    valid = rewards[~torch.isnan(rewards)].double()
    return float(valid.sum() / valid.numel()) if valid.numel() else math.nan


def identity(features):
    """Data collator that keeps the rows as they are (a list of dicts)."""
    return features


class _TorchOptimizerSync(TrainerCallback):
    """With ``es_optimizer='torch'``: after the optimizer moved the fp32 masters, apply AWD and render the model."""

    def __init__(self, trainer: ESTrainer):
        self.trainer = trainer

    def on_optimizer_step(self, args, state, control, **kwargs):
        trainer = self.trainer
        if args.es_optimizer == "torch":
            trainer._apply_awd(trainer._current_learning_rate())
            trainer.es_params.render_()


class _PromptBatchRollout(Rollout):
    """ESTrainer's rollout: generate for the iteration's prompt batch with the model as it is, score the completions
    with the reward functions, and return a :class:`MemberResult` (fitness = mean of the valid weighted rewards; its
    ``details`` hold the rewards, the invalid-reward flags, completions, tokens and seconds)."""

    def __init__(self, trainer: ESTrainer, rows: list[dict], step: int):
        self.trainer, self.rows, self.step = trainer, rows, step
        self.model = trainer.accelerator.unwrap_model(trainer.model)  # backends with per-row adapters find it here
        self.reward_kwargs = {"trainer_state": trainer.state, "log_extra": lambda *a, **k: None,
                              "log_metric": trainer._log_metric}

    def _score(self, rows: list[dict], num_row_groups: int = 1) -> dict:
        trainer = self.trainer
        start = time.perf_counter()
        out = score_model(
            self.model, trainer.processing_class, rows, trainer.reward_scorer, trainer.generation_config,
            trainer.args.num_generations, trainer.args.chat_template_kwargs, self.reward_kwargs,
            engine=trainer.generation_engine, num_row_groups=num_row_groups,
        )
        out["seconds"] = time.perf_counter() - start
        trainer._warn_invalid_rewards(out["invalid"])
        return out

    @staticmethod
    def _result(out: dict) -> MemberResult:
        fitness = math.nan if bool(out["invalid"].any()) else _fitness_of(out["rewards"])
        return MemberResult(fitness, out)

    def member(self, index: int) -> MemberResult:
        trainer, args = self.trainer, self.trainer.args
        if args.temperature > 0:  # the member's samples do not depend on which process scores it
            # (sharded: each process samples its own prompts, so each has its own stream)
            offset = (trainer.accelerator.process_index << 20) * trainer.sharded
            torch.manual_seed(member_seed(args.seed + 1 + offset, self.step, index))
        trainer._sync_model_view()  # ZeRO-3: the forward must gather the freshly perturbed partitions
        return self._result(self._score(self.rows))

    def stacked(self, indices) -> dict[int, MemberResult]:
        args = self.trainer.args
        if args.temperature > 0:
            # One random stream per generate call, keyed by its first member: chunks never share a stream. A
            # member's samples then depend on which members share its call (chunking, number of processes): with
            # sampling, the batched backend is not invariant to either (greedy decoding is).
            torch.manual_seed(member_seed(args.seed + 1, self.step, -1 - int(indices[0])))
        out = self._score(self.rows * len(indices), num_row_groups=len(indices))
        width = len(self.rows) * args.num_generations
        results = {}
        for k, index in enumerate(indices):
            block = slice(k * width, (k + 1) * width)
            part = {
                "rewards_per_func": out["rewards_per_func"][block],
                "invalid": out["invalid"][block],
                "rewards": out["rewards"][block],
                "completions": out["completions"][block],
                "num_tokens": sum(len(ids) for ids in out["completion_ids"][block]),
                "seconds": out["seconds"] / len(indices),
            }
            results[index] = self._result(part)
        return results


class ESTrainer(_BaseTrainer):
    """Evolution Strategies trainer (Qiu et al. 2025, arXiv 2509.24372), with GRPOTrainer's constructor.

    Each training step is one ES iteration: every process takes its share of ``prompt_batch_size`` prompts and the
    shares are gathered, so all members are scored on the same prompts; ``population_size`` members
    ``theta + sigma * eps_i`` are generated for and scored by the reward functions (the weights are perturbed in
    place and restored bitwise); the rewards are shaped (z-score by default); and
    ``theta <- theta + alpha / N * sum_i z_i eps_i`` is applied in fp32 (or handed to a torch optimizer).

    Launched on ``W`` processes (``torchrun``, ``accelerate launch``, ``deepspeed``; see ``docs/scaling.md``):
    without DeepSpeed or with ZeRO-1/2, *population parallelism*: every process holds the whole model (not wrapped in
    DDP), scores the members ``i % W == rank``, and per-member reward statistics are summed across processes; every
    process then applies the same update. With DeepSpeed ZeRO-3, *sharded ES*: every member is scored by all
    processes together, each on its share of the prompts, and each process perturbs, restores and updates only its
    partition of the parameters. Either way the weights end bitwise as with one process, given the same completions.

    Args:
        model (`str` or `PreTrainedModel`): A causal LM or its id/path (loaded with ``args.model_init_kwargs``).
        reward_funcs (`Callable | PreTrainedModel | str | list`): A reward function with TRL's signature
            ``f(prompts, completions, completion_ids, **columns) -> list[float | None]``, a sequence-classification
            reward model (or its id/path), or a list of them.
        args (`ESConfig`, *optional*): The configuration; default ``ESConfig(f"{model_name}-ES")``.
        train_dataset (`datasets.Dataset` or `datasets.IterableDataset`): Rows with a ``prompt`` (standard text or
            conversational messages); other columns reach reward functions as keyword arguments. An iterable
            (streaming) dataset needs ``max_steps``; every process reads the stream (see
            :meth:`_check_iterable_train_dataset`).
        eval_dataset (`datasets.Dataset`, *optional*): Scored by :meth:`evaluate` with the unperturbed model (an
            iterable one is read whole: it must be finite).
        processing_class (`PreTrainedTokenizerBase`, *optional*): Default: loaded from the model's path.
        reward_processing_classes (*optional*): Tokenizers of reward models, as in GRPOTrainer.
        callbacks (`list[TrainerCallback]`, *optional*): Extra Trainer callbacks.
        optimizers (*optional*): ``(optimizer, scheduler)`` as in ``Trainer``; with ``es_optimizer='torch'`` a given
            optimizer must own ``trainer.es_params.master_parameters()``.
        peft_config (`peft.PeftConfig`, *optional*): Wrap the model with PEFT; ES then perturbs the adapter only.

    Raises:
        ValueError: for a dataset without ``prompt`` or an empty dataset, an iterable train dataset without
            ``max_steps``, reward weights of the wrong length.
    """

    _tag_names = ["trl", "trl-es", "evolution-strategies"]
    _name = "ES"
    _paper = {
        "title": "Evolution Strategies at Scale: LLM Fine-Tuning Beyond Reinforcement Learning",
        "id": "2509.24372",
        "citation": textwrap.dedent("""\
            @article{qiu2025evolution,
                title   = {{Evolution Strategies at Scale: LLM Fine-Tuning Beyond Reinforcement Learning}},
                author  = {Xin Qiu and Yulu Gan and Conor F. Hayes and Qiyao Liang and Elliot Meyerson and Babak Hodjat and Risto Miikkulainen},
                year    = 2025,
                eprint  = {arXiv:2509.24372}
            }"""),
    }

    def __init__(
        self,
        model: str | PreTrainedModel,
        reward_funcs,
        args: ESConfig | None = None,
        train_dataset=None,
        eval_dataset=None,
        processing_class=None,
        reward_processing_classes=None,
        callbacks=None,
        optimizers=(None, None),
        peft_config=None,
    ):
        # Args
        if args is None:
            model_name = model if isinstance(model, str) else model.config._name_or_path
            args = ESConfig(f"{model_name.split('/')[-1]}-ES")
        if not isinstance(args, ESConfig):
            raise TypeError(f"args must be an ESConfig, got {type(args).__name__}.")

        # Model
        if isinstance(model, str):
            model = resolve_model_path(model)  # "embedded:SmolLM2-135M-Instruct" -> its local copy; others unchanged
            init_kwargs = dict(args.model_init_kwargs or {})
            init_kwargs.setdefault("dtype", "auto")
            model = AutoModelForCausalLM.from_pretrained(model, **init_kwargs)
        if peft_config is not None:
            from peft import get_peft_model

            model = get_peft_model(model, peft_config)

        # Processing class
        if processing_class is None:
            processing_class = AutoTokenizer.from_pretrained(model.config._name_or_path)
        if processing_class.pad_token is None:
            processing_class.pad_token = processing_class.eos_token

        # Rewards
        self.reward_scorer = RewardScorer(reward_funcs, args.reward_weights, reward_processing_classes)
        self.reward_func_names = self.reward_scorer.names

        # Data
        validate_dataset(train_dataset, "train_dataset")
        if train_dataset is not None and not hasattr(train_dataset, "__len__"):
            self._check_iterable_train_dataset(args)
        if isinstance(eval_dataset, dict):
            for key, dataset in eval_dataset.items():
                validate_dataset(dataset, f"eval_dataset[{key!r}]")
        else:
            validate_dataset(eval_dataset, "eval_dataset")

        # Generation
        self.generation_config = build_generation_config(
            processing_class, args.max_completion_length, args.temperature, args.top_p, args.generation_kwargs
        )

        super().__init__(
            model=model,
            args=args,
            data_collator=identity,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=processing_class,
            callbacks=callbacks,
            optimizers=optimizers,
        )
        self.model_accepts_loss_kwargs = False
        for func in self.reward_scorer.reward_funcs:
            if isinstance(func, nn.Module):
                func.to(self.accelerator.device)

        # ES state: built after Trainer placed the model on its device, so the tensors are the final ones (under
        # DeepSpeed ZeRO-3 it is rebuilt from the partitions once DeepSpeed has partitioned the model). The backend
        # checks the selection here, before any work.
        self.population = make_population_backend(args.population_backend, **self._population_backend_kwargs())
        self._build_es_state()
        lowrank = isinstance(self.population.perturbation, LowRankPerturbation)
        device = self.es_params.entries[0].param.device
        noise_source = args.noise_source
        if args.lean_memory and noise_source == "auto":  # no table: fresh blocks (device generator on CUDA)
            noise_source = "device_gaussian" if device.type == "cuda" else "gaussian"
        self.noise = make_noise_source(args.noise_table_size, noise_source, device, lowrank=lowrank)
        self.generation_engine = self._make_generation_engine()
        logger.info(
            "ESTrainer: population_backend=%s, perturbation=%s, noise=%s, generation_engine=%s, master copies %.1f "
            "MiB, anchor %s",
            args.population_backend, self.population.perturbation.describe(), self.noise.describe(),
            self.generation_engine.describe(), self.es_params.master_bytes / 2**20,
            "none" if self.anchor is None else self.anchor.storage,
        )
        self._comm_bytes = 0.0  # bytes moved into this process by ES's collectives since the last iteration
        self._forward_calls = 0  # model forward calls (decoding steps), counted under ZeRO-3
        self.seed_log = SeedLog(
            header={
                "noise": self.noise.describe(),
                "sigma": args.sigma,
                "population_size": args.population_size,
                "antithetic": args.antithetic,
                "fitness_shaping": args.fitness_shaping,
                "optimizer": args.es_optimizer,
                "master_dtype": "float32" if args.fp32_master_weights else None,
                "awd_penalty": args.awd_penalty,
                "parameters": [[e.name, e.numel] for e in self.es_params.entries],
                "perturbation": self.population.perturbation.describe(),
                "population_backend": self.population.describe(),
            }
        )
        self._metrics = defaultdict(list)
        self._warned_invalid: set[str] = set()
        self.add_callback(_TorchOptimizerSync(self))

    def _build_es_state(self) -> None:
        """The trained parameters (whole, or this process's ZeRO-3 partitions), their master and the anchor.

        With the low-rank backend and no ``include_parameters``, the selection is every ``nn.Linear`` weight that is
        not tied to another module (logged); the backend then checks the selection against the model, so a bad one
        raises here, before any work. A low-rank backend never writes the weights: a parameter already in the
        master dtype is its own master (no copy).
        """
        args = self.args
        unwrapped = self.accelerator.unwrap_model(self.model)
        lowrank = isinstance(self.population.perturbation, LowRankPerturbation)
        include = args.include_parameters
        if lowrank and include is None:
            names = linear_weight_names(unwrapped)
            if not names:
                raise ValueError("population_backend='batched_lowrank' found no trainable nn.Linear weight to train.")
            include = "^(?:" + "|".join(re.escape(n) for n in names) + ")$"
            logger.info("population_backend='batched_lowrank' trains the %d nn.Linear weights (set include_parameters "
                        "to choose others).", len(names))
        selected = select_parameters(unwrapped, include, args.exclude_parameters)
        self._es_model_params = [p for _, p in selected]
        self.es_params = TrainedParameters(
            es_parameter_entries(selected), torch.float32 if args.fp32_master_weights else None, share_params=lowrank
        )
        if not any(is_zero3_param(p) for p in self._es_model_params):
            self.population.check(self.es_params, unwrapped)
        self.anchor = None  # theta_0 (under ZeRO-3 the local partition): for AWD and drift logging
        if args.awd_lambda > 0 or args.log_parameter_drift:
            storage = "file" if args.lean_memory and args.anchor_storage == "auto" else args.anchor_storage
            files = checkpoint_files(unwrapped) if storage != "memory" else []
            anchor = make_anchor(self.es_params, storage, files)
            if args.lean_memory and anchor.resident_bytes:
                if args.awd_lambda > 0:
                    warnings.warn(f"lean_memory: the base checkpoint file does not hold theta_0 of every trained "
                                  f"tensor; AWD keeps {anchor.resident_bytes / 2**20:.1f} MiB of it in memory.",
                                  stacklevel=2)
                else:
                    logger.info("lean_memory: theta_0 is not in a checkpoint file; drift logging is skipped.")
                    anchor = None
            self.anchor = anchor

    def _make_generation_engine(self):
        """The generation engine of ``args.generation_engine`` (``"auto"``: compiled on CUDA where the model supports a
        static cache, eager otherwise and under ZeRO-3)."""
        name = self.args.generation_engine
        if name == "auto" and self.sharded:
            name = "eager"
        return make_engine(name, self.accelerator.unwrap_model(self.model), self.args.share_prompt_prefix)

    @property
    def sharded(self) -> bool:
        """Whether the trained parameters are DeepSpeed ZeRO-3 partitions (members are then scored by all processes
        together, each on its share of the prompts; see ``docs/scaling.md``)."""
        return any(is_zero3_param(p) for p in self._es_model_params)

    def _population_backend_kwargs(self) -> dict:
        """Backend-specific settings from the config."""
        if self.args.population_backend == "sequential":
            return {}
        return {"noise_rank": self.args.noise_rank, "member_chunk_size": self.args.member_chunk_size}

    # ------------------------------------------------------------------ data
    @staticmethod
    def _check_iterable_train_dataset(args: ESConfig) -> None:
        """An iterable (streaming) train dataset, as TRL's trainers take it: ``max_steps`` must say how long to train,
        and every process reads the stream itself.

        ``accelerate`` would otherwise *dispatch* an iterable dataset's batches: process 0 reads them and broadcasts
        them as tensors, which text rows are not. With ``dispatch_batches=False`` every process iterates the same
        stream and keeps its slice of each ``prompt_batch_size`` batch (``IterableDatasetShard``); the slices are then
        gathered as for a map-style dataset, so every process scores the same prompt rows in the same order. On resume,
        ``Trainer`` skips the batches already used by reading past them (unless ``ignore_data_skip``).

        Raises:
            ValueError: if ``max_steps`` is not set, or ``accelerator_config.dispatch_batches`` is ``True``.
        """
        if args.max_steps is None or args.max_steps <= 0:
            raise ValueError("train_dataset is an iterable (streaming) dataset, which has no length: set max_steps "
                             "(the number of ES iterations) to a positive value, or pass a map-style datasets.Dataset.")
        if args.accelerator_config.dispatch_batches:
            raise ValueError("accelerator_config.dispatch_batches=True cannot dispatch an iterable dataset's text rows "
                             "(accelerate broadcasts tensors only): leave it unset (None) or set it to False.")
        args.accelerator_config.dispatch_batches = False

    def _set_signature_columns_if_needed(self):
        # Rows go to the reward functions as they are: keep every column.
        if self._signature_columns is None:
            self._signature_columns = ["prompt"]

    def _gather_prompt_rows(self, rows: list[dict]) -> list[dict]:
        """Each process loaded its share of the prompt batch; with population parallelism every process needs all of
        it (``torch.distributed.all_gather_object``, counted in ``comm/bytes``). Sharded (ZeRO-3) processes keep their
        share: each generates for its own prompts."""
        if self.accelerator.num_processes == 1 or self.sharded:
            return list(rows)
        parts, nbytes = all_gather_objects(list(rows))
        self._comm_bytes += nbytes
        return [row for part in parts for row in part]

    # ------------------------------------------------------------------ distributed preparation
    def _prepare_for_training(self, max_steps, train_dataloader, resume_from_checkpoint):
        """Prepare the model without gradient machinery: ES has no backward pass and syncs no weights.

        One process: ``Trainer``'s own preparation. Several processes without DeepSpeed (population parallelism):
        the model goes through ``accelerator.prepare_model(model, evaluation_mode=True)``, i.e. it is *not* wrapped in
        ``DistributedDataParallel`` (DDP would broadcast the weights once and allocate gradient buckets as large as
        the model, never used). DeepSpeed: the engine is built without optimizer (see :func:`es_deepspeed_config`).
        The torch optimizer owning the fp32 masters and the scheduler are ``Trainer``'s, never given to DeepSpeed.
        Then the processes' weights are checked to be identical (population parallelism needs it).
        """
        if not self.is_deepspeed_enabled and self.accelerator.num_processes == 1:
            prepared = super()._prepare_for_training(max_steps, train_dataloader, resume_from_checkpoint)
            self._rebind_es_params()
            return prepared
        if self._created_lr_scheduler:
            self.lr_scheduler = None
            self._created_lr_scheduler = False
        if self.is_deepspeed_enabled:
            model = self._prepare_deepspeed_engine(max_steps)
            self.create_optimizer()
        else:
            model = self.accelerator.prepare_model(self.model, evaluation_mode=True)
            self.create_optimizer()
            self.optimizer = self.accelerator.prepare(self.optimizer)
        self.create_scheduler(num_training_steps=max_steps)
        self.model_wrapped = model
        if not self.sharded:
            self._rebind_es_params()
            self._check_replicas_identical()
        if resume_from_checkpoint is not None:
            if self.is_deepspeed_enabled:
                self._load_deepspeed_checkpoint(resume_from_checkpoint)
            self._load_optimizer_and_scheduler(resume_from_checkpoint)
            self._load_scaler(resume_from_checkpoint)
        for attr in ("model", "optimizer", "lr_scheduler"):
            setattr(self.callback_handler, attr, getattr(self, attr))
        self.callback_handler.train_dataloader = train_dataloader
        return model, train_dataloader

    def _prepare_deepspeed_engine(self, max_steps: int = 0):
        """``accelerator.prepare(model)`` under DeepSpeed with the ES config (no optimizer); built once.

        Under ZeRO-3 the ES state is then rebuilt from this process's partitions (``param.ds_tensor``).
        """
        if getattr(self, "deepspeed", None) is not None:
            return self.deepspeed
        plugin = self.accelerator.state.deepspeed_plugin
        hf_config = plugin.hf_ds_config
        hf_config.trainer_config_finalize(self.args, self.model, max_steps)  # fills "auto" values, as deepspeed_init
        es_deepspeed_config(hf_config.config, self.args.per_device_train_batch_size, self.accelerator.num_processes)
        if self.args.population_backend != "sequential" and hf_config.config["zero_optimization"].get("stage") == 3:
            raise ValueError("DeepSpeed ZeRO-3 needs population_backend='sequential' (members perturb partitions).")
        logger.info(ES_DEEPSPEED_NOTE)
        engine = self.accelerator.prepare(self.model)
        self.deepspeed = self.model_wrapped = engine
        if self.sharded:
            self._build_es_state()
            self.accelerator.unwrap_model(engine).register_forward_pre_hook(self._count_forward)
        return engine

    def _rebind_es_params(self) -> None:
        """Point the ES entries at the model's current tensors, keeping the masters.

        Preparing may move the parameters to new storage: accelerate's multi-process device is ``cpu:0`` (or
        ``cuda:r``), and ``model.to(device)`` then allocates new tensors even on the same device.

        Raises:
            RuntimeError: if a trained parameter changed shape.
        """
        named = dict(self.accelerator.unwrap_model(self.model).named_parameters())
        moved = False
        for entry in self.es_params.entries:
            current = named[entry.name].data
            if current.data_ptr() != entry.param.data_ptr():
                self.es_params.rebind_(entry.name, current)
                moved = True
        self._es_model_params = [named[entry.name] for entry in self.es_params.entries]
        if moved and self.optimizer is not None:
            # A master that is its parameter (low-rank backend, fp32) followed the new storage: the optimizer must
            # own the new tensors, or its steps would move tensors nothing reads.
            masters = self.es_params.master_parameters()
            if len(self.optimizer.param_groups) != 1 or len(self.optimizer.param_groups[0]["params"]) != len(masters):
                raise RuntimeError("ESTrainer's optimizer must hold exactly the ES masters in one parameter group.")
            if any(self.optimizer.state.get(p) for p in self.optimizer.param_groups[0]["params"]):
                raise RuntimeError("The ES masters moved after the optimizer took a step.")
            self.optimizer.param_groups[0]["params"] = masters

    def _count_forward(self, module, args):
        self._forward_calls += 1

    def _check_replicas_identical(self) -> None:
        """Population parallelism needs every process to hold the same weights and masters (DDP would have broadcast
        rank 0's weights). Compare a 16-byte fingerprint across processes; if they differ, broadcast rank 0's model
        state, masters and anchor (with a warning)."""
        unwrapped = self.accelerator.unwrap_model(self.model)
        state = [t for t in unwrapped.state_dict().values() if isinstance(t, torch.Tensor)]
        masters = list(self.es_params.master_state_dict().values())
        digest = fingerprint(state + masters)
        agree, nbytes = fingerprints_agree(digest, device=self.accelerator.device)
        self._comm_bytes += nbytes
        if agree:
            return
        warnings.warn(
            "The processes hold different initial weights: broadcasting process 0's model and ES master (as DDP "
            "would). Build or load the same model on every process to avoid this.",
            stacklevel=2,
        )
        with torch.no_grad():
            tensors = list(unwrapped.parameters()) + list(unwrapped.buffers())
            tensors += [e.master for e in self.es_params.entries if not e.master_is_param]
            self._comm_bytes += broadcast_tensors_(tensors)
        self.es_params.render_()
        if self.anchor is not None:  # theta_0 is now process 0's initial weights
            files = checkpoint_files(unwrapped) if self.args.anchor_storage != "memory" else []
            self.anchor = make_anchor(self.es_params, self.args.anchor_storage, files)

    def _sync_model_view(self) -> None:
        """Under ZeRO-3, drop gathered copies of the trained parameters so the next forward sees the partitions."""
        if self.sharded:
            release_gathered_(self._es_model_params)

    # ------------------------------------------------------------------ optimizer
    def create_optimizer(self, model=None):
        """The Trainer's optimizer class and kwargs, owning the fp32 master tensors (not the 16-bit parameters).

        With ``es_optimizer='es'`` it never receives a gradient, so ``step()`` is a no-op and allocates no state.
        """
        if self.optimizer is None:
            optimizer_cls, optimizer_kwargs = self.get_optimizer_cls_and_kwargs(self.args, model)
            groups = [{"params": self.es_params.master_parameters(), "weight_decay": self.args.weight_decay}]
            self.optimizer = optimizer_cls(groups, **optimizer_kwargs)
        return self.optimizer

    def _clip_grad_norm(self, model):
        masters = self.es_params.master_parameters()
        if not (self.sharded and self.accelerator.num_processes > 1):
            return torch.nn.utils.clip_grad_norm_(masters, self.args.max_grad_norm)
        # ZeRO-3: the masters are partitions; the norm is over the whole gradient estimate.
        grads = [m.grad for m in masters if m.grad is not None]
        square = torch.stack([g.double().pow(2).sum() for g in grads]).sum() if grads else torch.zeros((), dtype=torch.float64)
        square = self.accelerator.reduce(square.reshape(1).to(self.accelerator.device), reduction="sum").cpu()
        total = square.sqrt()[0]
        torch.nn.utils.clip_grads_with_norm_(masters, self.args.max_grad_norm, total)
        return total

    def _get_grad_norm(self, model, grad_norm=None):
        if grad_norm is None:
            grads = [m.grad for m in self.es_params.master_parameters() if m.grad is not None]
            if not grads:
                return None
            grad_norm = torch.nn.utils.get_total_norm(grads)
        return grad_norm.item() if hasattr(grad_norm, "item") else grad_norm

    def _current_learning_rate(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"]) if self.optimizer is not None else self.args.learning_rate

    # ------------------------------------------------------------------ the ES iteration
    def training_step(self, model, inputs, num_items_in_batch=None):
        """One ES iteration. Returns ``-mean(population fitness)`` as the logged "loss"."""
        args = self.args
        step = self.state.global_step  # iterations done so far; this one becomes step + 1
        rows = self._gather_prompt_rows(inputs)
        members = sample_population(args.seed, step, args.population_size, args.antithetic)
        world = self.accelerator.num_processes
        if self.sharded:  # ZeRO-3: every member is scored by all processes together, each on its own prompts
            indices = list(range(args.population_size))
        else:  # population parallelism: members i % W == rank, each on the whole prompt batch
            indices = member_indices(args.population_size, self.accelerator.process_index, world)

        start = time.perf_counter()
        forward_calls = self._forward_calls
        rollout = _PromptBatchRollout(self, rows, step)
        results = self.population.evaluate(self.es_params, self.noise, members, indices, args.sigma, rollout)
        evaluate_seconds = time.perf_counter() - start

        # Per member: reward sums and counts (overall and per function), completions, tokens. Summed over processes
        # (a few float64 per member travel, nothing else), so the fitness is the mean over all its completions.
        stats = self._member_stats(results, args.population_size)
        if world > 1:
            stats = self.accelerator.reduce(stats.to(self.accelerator.device), reduction="sum").cpu()
            self._comm_bytes += tensor_bytes(stats)
        count = stats[:, 1]
        # A member with an invalid (non-finite) reward, or with nothing scored, has no fitness: ranked worst.
        valid = (count > 0) & (stats[:, -2] == 0)
        fitness = torch.where(valid, stats[:, 0] / count.clamp(min=1), torch.full_like(count, math.nan))
        coefficients = shape_fitness(fitness, args.fitness_shaping)

        start = time.perf_counter()
        learning_rate, shrink = self._es_step(members, coefficients.tolist(), self._current_learning_rate())
        self._sync_model_view()
        update_seconds = time.perf_counter() - start
        self.seed_log.append(step + 1, members, coefficients.tolist(), learning_rate, shrink)

        self._record_comm(self._forward_calls - forward_calls)
        self._record_metrics(fitness, stats, results, evaluate_seconds, update_seconds)
        mean = fitness[~torch.isnan(fitness)].mean() if not torch.isnan(fitness).all() else torch.tensor(math.nan)
        return torch.tensor(-float(mean), device=args.device)

    def _es_step(self, members, coefficients: list[float], learning_rate: float) -> tuple[float, float]:
        """Move the weights for one iteration: the ES step along the perturbation (then AWD), or with
        ``es_optimizer='torch'`` the ES gradient for the Trainer's optimizer (which steps after this returns).

        Subclasses that combine ES with other updates (e.g. ES + SFT parallel averaging) override this.

        Returns:
            `(learning_rate, awd_shrink)`: what the seed log records for this iteration (the effective ``alpha`` of
            the ES step and ``alpha * lambda``), so that :func:`trl_es.replay` reproduces it.
        """
        perturbation = self.population.perturbation
        if self.args.es_optimizer == "es":
            es_update_(self.es_params, perturbation, self.noise, members, coefficients, learning_rate)
            return learning_rate, self._apply_awd(learning_rate)
        es_gradient_(self.es_params, perturbation, self.noise, members, coefficients)
        return learning_rate, learning_rate * self.args.awd_lambda if self.args.awd_lambda > 0 else 0.0

    def _member_stats(self, results: dict[int, MemberResult], population_size: int) -> torch.Tensor:
        """Columns: reward sum, reward count, completions, completion tokens, then per reward function its sums and
        its counts (NaN rewards skipped), then the number of invalid (non-finite) rewards, then the successes. One
        row per member, zero for members this process did not score.

        Returns:
            `torch.Tensor`: Shape ``(population_size, 6 + 2 * F)``, float64; the last column counts successes
            (weighted reward >= ``success_threshold``), the one before it invalid rewards.
        """
        num_funcs = len(self.reward_func_names)
        stats = torch.zeros(population_size, 6 + 2 * num_funcs, dtype=torch.float64)
        for index, result in results.items():
            out = result.details
            rewards = out["rewards"].double()
            per_func = out["rewards_per_func"].double()
            stats[index, 0] = rewards.nansum()
            stats[index, 1] = (~torch.isnan(rewards)).sum()
            stats[index, 2] = len(out["completions"])
            stats[index, 3] = out["num_tokens"]
            stats[index, 4 : 4 + num_funcs] = per_func.nansum(dim=0)
            stats[index, 4 + num_funcs : 4 + 2 * num_funcs] = (~torch.isnan(per_func)).sum(dim=0)
            stats[index, -2] = out["invalid"].sum()
            stats[index, -1] = (rewards >= self.args.success_threshold).sum()  # NaN compares False
        return stats

    def _record_comm(self, forward_calls: int) -> None:
        """Log ``comm/bytes``: the bytes moved into this process by collectives during the iteration.

        Counted exactly (buffer sizes): the prompt rows gathered (population parallelism), the per-member statistics
        all-reduced, fingerprint checks. Under ZeRO-3 also: ``generate(synced_gpus=True)``'s one float32 all-reduce
        per decoding step, and the parameters DeepSpeed all-gathers, estimated as one full gather of every
        partitioned parameter per forward call (``comm/param_gather_bytes``; an upper bound: small persistent
        parameters are gathered once per member).
        """
        nbytes = self._comm_bytes
        if self.sharded and self.accelerator.num_processes > 1:
            unwrapped = self.accelerator.unwrap_model(self.model)
            full = sum(int(p.ds_numel) * p.element_size() for p in unwrapped.parameters() if is_zero3_param(p))
            gathered = float(forward_calls * full)
            self._metrics["comm/param_gather_bytes"].append(gathered)
            nbytes += 4 * forward_calls + gathered
        self._metrics["comm/bytes"].append(float(nbytes))
        self._comm_bytes = 0.0

    def _apply_awd(self, learning_rate: float) -> float:
        """Anchored Weight Decay after the ES step (arXiv 2605.30148, Algorithm 1). Returns ``alpha * lambda``."""
        if self.args.awd_lambda <= 0:
            return 0.0
        shrink = learning_rate * self.args.awd_lambda
        self.es_params.anchored_weight_decay_(self.anchor, shrink, self.args.awd_penalty)
        return shrink

    def _log_metric(self, name: str, value: float) -> None:
        self._metrics[name].append(float(value))

    def _warn_invalid_rewards(self, invalid: torch.Tensor) -> None:
        """Warn once per reward function that returned a non-finite number (its member is ranked worst)."""
        for j in torch.nonzero(invalid.any(dim=0)).flatten().tolist():
            name = self.reward_func_names[j]
            if name not in self._warned_invalid:
                self._warned_invalid.add(name)
                warnings.warn(
                    f"Reward function {name!r} returned a non-finite reward (NaN or +-inf). Such a reward never reaches "
                    "the weights: the member that produced it gets no fitness and is ranked worst (counted in "
                    "num_nan_members and num_invalid_rewards); evaluate() leaves it out of the means. Return None for "
                    "'not applicable'. This warning is shown once per reward function.",
                    stacklevel=2,
                )

    def _record_metrics(self, fitness, stats, results, evaluate_seconds, update_seconds):
        """Log the population's fitness and rewards (from ``stats``, summed over processes: the same on every
        process and for any number of processes) and this process's timings and throughput."""
        finite = fitness[~torch.isnan(fitness)]
        if finite.numel():
            self._metrics["reward"].append(float(finite.mean()))
            self._metrics["reward_std"].append(float(finite.std(unbiased=False)))
            self._metrics["reward_min"].append(float(finite.min()))
            self._metrics["reward_max"].append(float(finite.max()))
        self._metrics["num_nan_members"].append(float(torch.isnan(fitness).sum()))
        self._metrics["num_invalid_rewards"].append(float(stats[:, -2].sum()))
        scored = stats[:, 2] > 0
        if scored.any():  # population success diversity JS_succ (arXiv 2608.27351)
            success_rates = stats[scored, -1] / stats[scored, 2]
            self._metrics["success_rate"].append(float(success_rates.mean()))
            self._metrics["success_diversity"].append(success_diversity(success_rates))
        generation_seconds = sum(r.details["seconds"] for r in results.values())
        num_funcs = len(self.reward_func_names)
        totals = stats.sum(dim=0)
        for j, name in enumerate(self.reward_func_names):
            if totals[4 + num_funcs + j] > 0:
                self._metrics[f"rewards/{name}/mean"].append(float(totals[4 + j] / totals[4 + num_funcs + j]))
        if results:
            completions = sum(len(r.details["completions"]) for r in results.values())
            self._metrics["completions_per_second"].append(completions / max(generation_seconds, 1e-9))
        self._metrics["completion_tokens"].append(float(totals[3]))
        timings = self.population.timings
        self._metrics["time/generation_and_reward"].append(generation_seconds)
        self._metrics["time/perturb"].append(timings.get("perturb", 0.0))
        self._metrics["time/restore"].append(timings.get("restore", 0.0))
        self._metrics["time/update"].append(update_seconds)
        self._metrics["time/other"].append(max(0.0, evaluate_seconds - generation_seconds - sum(timings.values())))

    def _parameter_drift(self) -> dict[str, float]:
        """``||theta - theta_0||`` and ``||theta - theta_0|| / ||theta_0||`` over the trained parameters (fp64 sums),
        for the whole model (``drift/l2``, ``drift/relative``) and per module type (``drift/l2/q_proj``, ...; the
        grouping of :func:`trl_es.analysis.parameter_drift`)."""
        groups = sorted({group_name(name) for name in self.anchor})
        sums = torch.zeros(len(groups) + 1, 2, dtype=torch.float64)  # row 0: whole model
        for name, master in self.es_params.master_state_dict().items():
            flat, theta0 = master.detach().reshape(-1), self.anchor[name].reshape(-1)
            row = torch.zeros(2, dtype=torch.float64)
            for lo in range(0, flat.numel(), NOISE_BLOCK_SIZE):  # in blocks: no model-sized float64 temporaries
                current = flat[lo : lo + NOISE_BLOCK_SIZE].double()
                initial = theta0[lo : lo + NOISE_BLOCK_SIZE].to(current.device).double()
                row += torch.stack([(current - initial).pow(2).sum(), initial.pow(2).sum()]).cpu()
            sums[0] += row
            sums[1 + groups.index(group_name(name))] += row
        if self.sharded and self.accelerator.num_processes > 1:  # each process holds a partition
            sums = self.accelerator.reduce(sums.to(self.accelerator.device), reduction="sum").cpu()
            self._comm_bytes += tensor_bytes(sums)
        drift = {}
        for key, (diff_sq, base_sq) in zip(["", *[f"/{g}" for g in groups]], sums.tolist()):
            norm = math.sqrt(diff_sq)
            drift[f"drift/l2{key}"] = norm
            drift[f"drift/relative{key}"] = norm / math.sqrt(base_sq) if base_sq > 0 else 0.0
        return drift

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if not any(key.startswith("eval_") for key in logs):
            for key, values in self._metrics.items():
                valid = [v for v in values if not math.isnan(v)]
                logs[key] = sum(valid) / len(valid) if valid else None
            self._metrics.clear()
            if self.anchor is not None and self.args.log_parameter_drift:
                logs.update(self._parameter_drift())
        super().log(logs, start_time)

    # ------------------------------------------------------------------ evaluation
    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval") -> dict[str, float]:
        """Score the unperturbed model on ``eval_dataset`` and log ``eval_reward`` (and per-function means).

        Each process scores its share of the prompts (every ``W``-th row), ``per_device_eval_batch_size`` prompts per
        generate call (``num_generations`` completions each), with the trainer's generation engine and settings.
        Invalid (non-finite) rewards are left out of the means and counted.

        Returns:
            `dict[str, float]`: ``{prefix}_reward``, ``{prefix}_rewards/{name}/mean``, ``{prefix}_num_completions``,
            ``{prefix}_num_invalid_rewards``, ``{prefix}_runtime``.
        """
        if isinstance(eval_dataset, str):
            eval_dataset = self.eval_dataset[eval_dataset]
        dataset = eval_dataset if eval_dataset is not None else self.eval_dataset
        if dataset is None:
            raise ValueError("evaluate() needs an eval_dataset (given to ESTrainer or to evaluate).")
        if isinstance(dataset, dict):
            metrics = {}
            for key, subset in dataset.items():
                metrics.update(self.evaluate(subset, ignore_keys, f"{metric_key_prefix}_{key}"))
            return metrics
        validate_dataset(dataset, "eval_dataset")
        if not hasattr(dataset, "__len__"):  # an iterable eval dataset: read whole (it must be finite)
            dataset = list(dataset)
        if self.is_deepspeed_enabled and self.sharded and getattr(self, "deepspeed", None) is None:
            self._prepare_deepspeed_engine()  # ZeRO-3 partitioned at load time: generation needs the engine's hooks
        self._sync_model_view()
        rank, world = self.accelerator.process_index, self.accelerator.num_processes
        rows = [dataset[i] for i in range(rank, len(dataset), world)]
        unwrapped = self.accelerator.unwrap_model(self.model)
        batch = self.args.per_device_eval_batch_size
        # Under ZeRO-3 every process must run as many generate calls as the others (each forward gathers the
        # parameters from all of them): processes short of prompts score a placeholder batch and drop it.
        num_batches = math.ceil(math.ceil(len(dataset) / world) / batch) if self.sharded else None
        sums = torch.zeros(3 + len(self.reward_func_names), dtype=torch.float64)  # total, count, invalid, per function
        counts = torch.zeros(len(self.reward_func_names), dtype=torch.float64)
        if self.args.temperature > 0:
            torch.manual_seed(self.args.seed)
        start = time.perf_counter()
        for first in range(0, len(rows) if num_batches is None else num_batches * batch, batch):
            chunk = rows[first : first + batch]
            if not chunk:  # ZeRO-3 only: take part in the others' forwards, score nothing
                placeholder = prompt_texts([dataset[0]], self.processing_class, self.args.chat_template_kwargs)
                generate_completions(unwrapped, self.processing_class, placeholder, self.generation_config,
                                     engine=self.generation_engine)
                continue
            out = score_model(
                unwrapped, self.processing_class, chunk, self.reward_scorer,
                self.generation_config, self.args.num_generations, self.args.chat_template_kwargs,
                {"trainer_state": self.state, "log_extra": lambda *a, **k: None, "log_metric": lambda *a, **k: None},
                engine=self.generation_engine,
            )
            self._warn_invalid_rewards(out["invalid"])
            rewards = out["rewards"].double()
            valid_rows = ~out["invalid"].any(dim=1)
            sums[0] += rewards[valid_rows].nansum()
            sums[1] += (~torch.isnan(rewards[valid_rows])).sum()
            sums[2] += out["invalid"].sum()
            per_func = out["rewards_per_func"].double()
            sums[3:] += per_func.nansum(dim=0)
            counts += (~torch.isnan(per_func)).sum(dim=0)
        if world > 1:
            sums = self.accelerator.reduce(sums.to(self.accelerator.device), "sum").cpu()
            counts = self.accelerator.reduce(counts.to(self.accelerator.device), "sum").cpu()
        metrics = {
            f"{metric_key_prefix}_reward": float(sums[0] / sums[1]) if sums[1] > 0 else None,
            f"{metric_key_prefix}_num_completions": int(len(dataset) * self.args.num_generations),
            f"{metric_key_prefix}_num_invalid_rewards": int(sums[2]),
            f"{metric_key_prefix}_runtime": time.perf_counter() - start,
        }
        for j, name in enumerate(self.reward_func_names):
            if counts[j] > 0:
                metrics[f"{metric_key_prefix}_rewards/{name}/mean"] = float(sums[3 + j] / counts[j])
        self.log(metrics)
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics)
        return metrics

    # ------------------------------------------------------------------ checkpoints
    def train(self, *args, **kwargs):
        """``Trainer.train``, then the seed log is written to ``output_dir`` (a whole run in a few kilobytes).

        Whatever the population backend installed in the model (the low-rank adapters' hooks) is removed at the end,
        also when training raises.
        """
        try:
            output = super().train(*args, **kwargs)
        finally:
            self.population.close()
        if self.args.should_save:
            os.makedirs(self.args.output_dir, exist_ok=True)
            self.seed_log.save(os.path.join(self.args.output_dir, SEED_LOG_NAME))
        return output

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False):
        """Save the model as ``Trainer`` does, plus the seed log (``es_seed_log.jsonl``).

        Under ZeRO-3 ``Trainer`` gathers the partitions into one ``from_pretrained``-loadable model (DeepSpeed's
        ``stage3_gather_16bit_weights_on_model_save``, which ES turns on by default); every process must call this.
        """
        self._sync_model_view()
        self._keep_anchor_out_of(output_dir or self.args.output_dir)
        super().save_model(output_dir, _internal_call)
        output_dir = output_dir or self.args.output_dir
        if self.args.should_save:
            # save_pretrained writes nothing on a torch.distributed rank != 0 (e.g. the first process of a second
            # node with save_on_each_node): fail here rather than leave a folder without weights.
            require_files(output_dir, SAVED_MODEL_FILES, "the model saved by ESTrainer")
            self.seed_log.save(os.path.join(output_dir, SEED_LOG_NAME))

    def _keep_anchor_out_of(self, folder: str) -> None:
        """Before writing a model into ``folder``: if theta_0 is read from a file there, hold it in memory first (the
        write would replace the file theta_0 is read from)."""
        if isinstance(self.anchor, FileAnchor) and os.path.abspath(folder) in self.anchor.folders:
            logger.warning("Saving into %s, which holds the file theta_0 is read from: theta_0 is now kept in memory.",
                           folder)
            self.anchor = self.anchor.materialize()

    def _save_checkpoint(self, model, trial):
        super()._save_checkpoint(model, trial)
        folder = os.path.join(self._get_output_dir(trial=trial), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        if self.sharded:
            self._save_es_shards(folder)
            return
        if not self.args.should_save:
            return
        # The model's weights are a rendering of the master: save the master too when they differ in dtype.
        masters = self.es_params.master_state_dict()
        if any(e.master.dtype != e.param.dtype for e in self.es_params.entries):
            with atomic_path(os.path.join(folder, MASTER_WEIGHTS_NAME)) as tmp:
                save_file({n: t.detach().cpu().contiguous() for n, t in masters.items()}, tmp)
        if self.anchor is not None:
            with atomic_path(os.path.join(folder, ANCHOR_WEIGHTS_NAME)) as tmp:
                save_file({n: t.contiguous() for n, t in self.anchor.items()}, tmp)

    def _save_es_shards(self, folder: str) -> None:
        """ZeRO-3: every process writes its partitions of the master (when it differs in dtype from the model, i.e.
        an fp32 master of a 16-bit model) and of the anchor, as ``es_master.rank{r}-of-{W}.safetensors`` with each
        tensor's ``[start, start + len)`` in the file's metadata. The 16-bit model itself is gathered by ``Trainer``.
        """
        rank, world = self.accelerator.process_index, self.accelerator.num_processes
        os.makedirs(folder, exist_ok=True)
        metadata = {e.name: f"{e.start},{e.param.numel()},{e.numel}" for e in self.es_params.entries}
        suffix = f".rank{rank:05d}-of-{world:05d}.safetensors"
        if any(e.master.dtype != e.param.dtype for e in self.es_params.entries):
            masters = {n: t.detach().cpu().contiguous() for n, t in self.es_params.master_state_dict().items()}
            with atomic_path(os.path.join(folder, MASTER_WEIGHTS_NAME.replace(".safetensors", suffix))) as tmp:
                save_file(masters, tmp, metadata)
        if self.anchor is not None:
            anchor = {n: t.contiguous() for n, t in self.anchor.items()}
            with atomic_path(os.path.join(folder, ANCHOR_WEIGHTS_NAME.replace(".safetensors", suffix))) as tmp:
                save_file(anchor, tmp, metadata)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """Under DeepSpeed the optimizer is ``Trainer``'s torch optimizer over ES's masters, not DeepSpeed's: save it
        and the scheduler as without DeepSpeed (per process under ZeRO-3, where the masters are partitions) instead
        of a DeepSpeed engine checkpoint (which would hold no optimizer and, under ZeRO-3, no weights)."""
        if not self.is_deepspeed_enabled:
            return super()._save_optimizer_and_scheduler(output_dir)
        os.makedirs(output_dir, exist_ok=True)
        rank, world = self.accelerator.process_index, self.accelerator.num_processes
        if self.args.es_optimizer == "torch" and (self.sharded or self.args.should_save):
            name = f"optimizer.rank{rank:05d}-of-{world:05d}.pt" if self.sharded else "optimizer.pt"
            with atomic_path(os.path.join(output_dir, name)) as tmp:
                torch.save(self.optimizer.state_dict(), tmp)
        if self.args.should_save:
            with atomic_path(os.path.join(output_dir, "scheduler.pt")) as tmp:
                torch.save(self.lr_scheduler.state_dict(), tmp)

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        super()._load_from_checkpoint(resume_from_checkpoint, model)
        self._load_es_state(resume_from_checkpoint)

    def _load_es_state(self, folder: str) -> None:
        """The checkpoint's ES master, anchor and seed log, whatever number of processes wrote it (one file each, or
        ZeRO-3's per-process shards): every process reads exactly its elements (:func:`read_flat_ranges`).

        Raises:
            ValueError: if the checkpoint's seed log was written for other trained parameters, noise, perturbation or
                sigma than this run's (before any iteration runs).
        """
        log_path = os.path.join(folder, SEED_LOG_NAME)
        if os.path.exists(log_path):
            saved_log = SeedLog.load(log_path)
            for key in ("noise", "perturbation", "sigma", "parameters"):
                if key in saved_log.header and saved_log.header[key] != self.seed_log.header.get(key):
                    raise ValueError(f"Cannot resume from {folder!r}: its seed log's {key!r} differs from this run's "
                                     f"({saved_log.header[key]!r} vs {self.seed_log.header.get(key)!r}).")
        layout = {e.name: (e.start, e.param.numel()) for e in self.es_params.entries}
        masters = read_flat_ranges(folder, MASTER_WEIGHTS_NAME, layout)
        if masters is not None:
            self.es_params.load_master_state_dict(masters)
        else:  # the master has the model's dtype: the model just loaded is the master
            self.es_params.refresh_master_from_model_()
        if self.anchor is not None:
            anchor = read_flat_ranges(folder, ANCHOR_WEIGHTS_NAME, layout)
            if anchor is not None:
                self._adopt_checkpoint_anchor(anchor)
        if os.path.exists(log_path):
            self.seed_log.records = saved_log.records

    def _adopt_checkpoint_anchor(self, saved: dict[str, torch.Tensor]) -> None:
        """Use the checkpoint's theta_0: keep the current anchor where it holds the same values (e.g. read from the
        base model's file), else hold the checkpoint's values in memory (a resumed run decays toward the anchor of
        the run it continues, whatever model it was started from)."""
        same = all(torch.equal(saved[n].reshape(-1), self.anchor[n].reshape(-1).to(saved[n].dtype))
                   for n in self.anchor)
        if not same:
            shapes = {e.name: e.param.shape for e in self.es_params.entries}
            self.anchor = MemoryAnchor({n: saved[n].view(shapes[n]) for n in self.anchor})

    def _load_deepspeed_checkpoint(self, folder: str) -> None:
        """Resume under DeepSpeed from a checkpoint written by this trainer, to the same weights as an uninterrupted run.

        The checkpoint holds the model gathered into ``model.safetensors`` (or shards with an index; written by
        every ZeRO stage), the ES master and anchor (one file, or ZeRO-3's per-process shards with each tensor's
        ``start,length,numel`` in the metadata) and the seed log. Every process copies its share: its partition of
        every trained tensor under ZeRO-3, whole tensors otherwise, whatever number of processes wrote the
        checkpoint (:func:`read_flat_ranges`). Runs before any iteration; raises ``ValueError`` for a PEFT model (its
        adapter checkpoint is not read here), a checkpoint without the gathered model, or, with
        ``es_optimizer='torch'``, an optimizer state written by another number of processes. (DeepSpeed's own
        engine checkpoint is never written: ES has no DeepSpeed optimizer.)
        """
        rank, world = self.accelerator.process_index, self.accelerator.num_processes
        unwrapped = self.accelerator.unwrap_model(self.model)
        if hasattr(unwrapped, "peft_config"):
            raise ValueError("Resuming a PEFT model under DeepSpeed is not supported: start a new run from the "
                             "checkpoint's adapter, or resume without DeepSpeed.")
        files = checkpoint_model_files(folder)
        missing = [e.name for e in self.es_params.entries if e.name not in files]
        if not files or missing:
            raise ValueError(f"Cannot resume ESTrainer under DeepSpeed from {folder!r}: its gathered model "
                             f"(model.safetensors) {'is missing' if not files else f'lacks {missing[:3]}'}.")
        optimizer_path = None
        if self.args.es_optimizer == "torch":
            name = f"optimizer.rank{rank:05d}-of-{world:05d}.pt" if self.sharded else "optimizer.pt"
            optimizer_path = os.path.join(folder, name)
            if not os.path.isfile(optimizer_path):
                raise ValueError(f"Cannot resume es_optimizer='torch' from {folder!r}: no {name} (its optimizer state "
                                 "is per process: resume with the number of processes that wrote it).")
        with torch.no_grad():
            for e in self.es_params.entries:
                with safe_open(files[e.name], framework="pt") as f:
                    flat = f.get_tensor(e.name).reshape(-1)
                e.param.view(-1).copy_(flat[e.start : e.start + e.param.numel()])
        self._load_es_state(folder)
        if optimizer_path is not None:
            self.optimizer.load_state_dict(torch.load(optimizer_path, weights_only=True))
        self._sync_model_view()
