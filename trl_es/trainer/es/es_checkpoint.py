"""ESTrainer's checkpoint I/O: the seed log beside every saved model, the fp32 master and theta_0 in checkpoints (one
file, or one shard per process under ZeRO-3), and resume to the weights of an uninterrupted run.

Every ``Trainer`` path that loads other weights (resume, ``load_best_model_at_end``, ``model_init``) keeps the ES state
(master, anchor, seed log) in step; a checkpoint is checked before anything is loaded. Files go through
:mod:`trl_es.files` (complete or absent).
"""

from __future__ import annotations

import json
import os

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint
from transformers.utils import logging

from ...es.anchor import FileAnchor, MemoryAnchor, checkpoint_weight_map
from ...es.seedlog import SEED_LOG_NAME, SeedLog, header_perturbation
from ...files import SAVED_MODEL_FILES, atomic_path, is_present, missing_files, require_files
from ...quantized import HEADER_KEY
from ..distributed import SHARD_PATTERN, read_flat_ranges
from .model_card import model_card_name, write_model_card


logger = logging.get_logger(__name__)

MASTER_WEIGHTS_NAME = "es_master.safetensors"
ANCHOR_WEIGHTS_NAME = "es_anchor.safetensors"
TRAINER_STATE_NAME = "trainer_state.json"
SCHEDULER_NAME = "scheduler.pt"
OPTIMIZER_NAME = "optimizer.pt"

#: ``resume_from_checkpoint`` value (in ``ESConfig`` or passed to ``train``): resume from the newest complete
#: checkpoint in ``output_dir`` if there is one, else start fresh
#: (:meth:`ESCheckpointMixin._latest_complete_checkpoint`).
AUTO_RESUME = "latest"

#: Seed-log header keys that :func:`trl_es.replay` or a resumed run reads, with the settings that decide them (named
#: in the error when a resumed run's value differs from the checkpoint's).
RESUME_HEADER_FIELDS = {
    "noise": "noise_source/noise_table_size",
    "sigma": "sigma",
    "population_size": "population_size",
    "antithetic": "antithetic",
    "fitness_shaping": "fitness_shaping",
    "optimizer": "es_optimizer",
    "master_dtype": "fp32_master_weights",
    "awd_penalty": "awd_penalty",
    "parameters": "include_parameters/exclude_parameters (the trained parameters)",
    "perturbation": "population_backend/noise_rank",
}

#: Config fields that set the rest of a run's trajectory (the prompts, the fitness, the learning rate of each step),
#: kept in the seed-log header under ``run_settings`` and compared on resume. ``reward_funcs`` (the reward functions'
#: names) is kept there too.
RESUME_SETTINGS = (
    "seed", "learning_rate", "lr_scheduler_type", "lr_scheduler_kwargs", "warmup_steps", "awd_lambda",
    "per_prompt_shaping", "prompt_batch_size", "num_generations", "max_completion_length", "temperature", "top_p",
    "generation_kwargs", "chat_template_kwargs", "reward_weights", "member_chunk_size", "bf16", "fp16",
    "train_sampling_strategy", "data_seed", "dataloader_drop_last",
)
#: With ``es_optimizer="torch"`` also the optimizer's settings (its state is loaded from ``optimizer.pt``).
TORCH_OPTIMIZER_SETTINGS = ("optim", "optim_args", "weight_decay", "adam_beta1", "adam_beta2", "adam_epsilon",
                            "max_grad_norm")


def run_settings(args, reward_func_names) -> dict:
    """The ``run_settings`` of a seed-log header: :data:`RESUME_SETTINGS` (and :data:`TORCH_OPTIMIZER_SETTINGS` with
    ``es_optimizer="torch"``) of ``args`` and the reward functions' names, as JSON values."""
    names = RESUME_SETTINGS + (TORCH_OPTIMIZER_SETTINGS if args.es_optimizer == "torch" else ())
    settings = {name: getattr(getattr(args, name, None), "value", getattr(args, name, None)) for name in names}
    settings["reward_funcs"] = list(reward_func_names)
    return json.loads(json.dumps(settings, default=str))


def _present_or_sharded(folder: str, name: str) -> bool:
    """``name`` is there, or ZeRO-3's non-empty shards of it for every rank ``0..W-1`` of one world size ``W``."""
    if is_present(folder, name):
        return True
    stem = name[: -len(".safetensors")]
    shards = [(m, n) for n in os.listdir(folder) if (m := SHARD_PATTERN.match(n)) and m["base"] == stem]
    worlds = {int(m["world"]) for m, _ in shards}
    if len(worlds) != 1:
        return False
    ranks = {int(m["rank"]) for m, n in shards if is_present(folder, n)}
    return ranks == set(range(worlds.pop()))


def _checkpoint_step(name: str) -> int | None:
    """``N`` of a ``checkpoint-N`` folder name, else ``None``."""
    prefix = f"{PREFIX_CHECKPOINT_DIR}-"
    return int(name[len(prefix):]) if name.startswith(prefix) and name[len(prefix):].isdigit() else None


class ESCheckpointMixin:
    """Saving and resuming an ES run (see the module docstring)."""

    def train(self, resume_from_checkpoint=None, trial=None, **kwargs):
        """``Trainer.train``, then the seed log is written to ``output_dir``.

        ``resume_from_checkpoint=None`` takes the config's (a folder, or ``"latest"``: :data:`AUTO_RESUME`).

        Raises:
            ValueError: if the checkpoint fails :meth:`_check_checkpoint`.
        """
        if resume_from_checkpoint is None:  # False starts fresh
            resume_from_checkpoint = getattr(self.args, "resume_from_checkpoint", None) or None
        if resume_from_checkpoint == AUTO_RESUME:  # a job relaunched after preemption resumes by itself
            resume_from_checkpoint = self._latest_complete_checkpoint()
        if resume_from_checkpoint is True:
            resume_from_checkpoint = get_last_checkpoint(self.args.output_dir) or True  # None: Trainer says so
        if isinstance(resume_from_checkpoint, (str, os.PathLike)):
            resume_from_checkpoint = os.fspath(resume_from_checkpoint)
            self._check_checkpoint(resume_from_checkpoint)
        try:
            output = super().train(resume_from_checkpoint, trial, **kwargs)
        finally:
            self.population.close()  # removes what the backend installed in the model (low-rank hooks)
        if self.args.should_save:
            os.makedirs(self.args.output_dir, exist_ok=True)
            self.seed_log.save(os.path.join(self.args.output_dir, SEED_LOG_NAME))
        return output

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False):
        """Save the model as ``Trainer`` does, plus the seed log and, outside a checkpoint, the model card; in a
        checkpoint (``_internal_call``) also the ES state (:meth:`_save_es_state`). Every process must call this.

        Raises:
            RuntimeError: if ``save_pretrained`` wrote no weights or no config where this process should have
                written them.
        """
        self._sync_model_view()
        self._keep_anchor_out_of(output_dir or self.args.output_dir)
        super().save_model(output_dir, _internal_call)
        output_dir = output_dir or self.args.output_dir
        if self.args.should_save:
            # save_pretrained writes nothing on a torch.distributed rank != 0: fail here rather than leave a folder
            # without weights (ESConfig refuses save_on_each_node=True for the same reason).
            require_files(output_dir, SAVED_MODEL_FILES, "the model saved by ESTrainer")
            self.seed_log.save(os.path.join(output_dir, SEED_LOG_NAME))
        if _internal_call:  # before trainer_state.json marks the checkpoint and old ones are rotated away
            self._save_es_state(output_dir)
        else:  # a checkpoint's card is written in output_dir by _save_checkpoint; a saved model gets its own
            write_model_card(self, output_dir, model_card_name(self.args, output_dir))

    def create_model_card(self, model_name: str | None = None, dataset_name: str | None = None,
                          tags: str | list[str] | None = None) -> None:
        """TRL's ``create_model_card``: ``output_dir/README.md``, with the ES settings (main process only).

        Args:
            model_name (`str`, *optional*): The trained model's name.
            dataset_name (`str`, *optional*): The training dataset's hub id; default: the train dataset's, if known.
            tags (`str` or `list[str]`, *optional*): Tags besides ``trl``, ``trl-es``, ``evolution-strategies``.
        """
        write_model_card(self, self.args.output_dir, model_name, dataset_name, tags)

    def _save_checkpoint(self, model, trial):
        """As GRPOTrainer: the model card in ``output_dir`` first (so ``hub_strategy="every_save"`` pushes it), then
        the checkpoint."""
        self.create_model_card(model_name=model_card_name(self.args, self.args.output_dir))
        super()._save_checkpoint(model, trial)

    def _keep_anchor_out_of(self, folder: str) -> None:
        """Before writing a model into ``folder``: if theta_0 is read from a file there, hold it in memory first (the
        write would replace the file theta_0 is read from)."""
        if isinstance(self.anchor, FileAnchor) and os.path.abspath(folder) in self.anchor.folders:
            logger.warning("Saving into %s, which holds the file theta_0 is read from: theta_0 is now kept in memory.",
                           folder)
            self.strategy.anchor = self.anchor.materialize()

    def _save_es_state(self, folder: str) -> None:
        """Write the fp32 master (if not the model's dtype) and theta_0; under ZeRO-3 one shard per process."""
        if self.sharded:
            self._save_es_shards(folder)
            return
        if not self.args.should_save:
            return
        masters = self.es_params.master_state_dict()
        if any(e.master.dtype != e.param.dtype for e in self.es_params.entries):  # else the model is the master
            with atomic_path(os.path.join(folder, MASTER_WEIGHTS_NAME)) as tmp:
                save_file({n: t.detach().cpu().contiguous() for n, t in masters.items()}, tmp)
        if self.anchor is not None:
            with atomic_path(os.path.join(folder, ANCHOR_WEIGHTS_NAME)) as tmp:
                save_file({n: t.contiguous() for n, t in self.anchor.items()}, tmp)

    def _save_es_shards(self, folder: str) -> None:
        """ZeRO-3: every process writes its partitions of the master (if not the model's dtype) and of the anchor, as
        ``es_master.rank{r}-of-{W}.safetensors``."""
        rank, world = self.accelerator.process_index, self.accelerator.num_processes
        os.makedirs(folder, exist_ok=True)
        metadata = {e.name: f"{e.start},{e.param.numel()},{e.numel}" for e in self.es_params.entries}  # start,len,numel
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
        """Under DeepSpeed, save the torch optimizer over ES's masters (per process under ZeRO-3) and the scheduler as
        without DeepSpeed, instead of a DeepSpeed engine checkpoint."""
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

    # ------------------------------------------------------------------ what a checkpoint must hold
    def _missing_checkpoint_files(self, folder: str, resume: bool = True) -> list[str]:
        """The files of ``folder`` that this run needs and that are absent (or empty); ``resume`` adds the trainer
        state, scheduler, RNG state and (``es_optimizer="torch"``) optimizer files."""
        missing = missing_files(folder, SAVED_MODEL_FILES)  # the model (or a PEFT adapter) and its config
        index = os.path.join(folder, "model.safetensors.index.json")
        if not is_present(folder, "model.safetensors") and os.path.isfile(index):
            shards = sorted(set(checkpoint_weight_map(folder).values()))
            missing += [os.path.basename(f) for f in shards if not is_present(folder, os.path.basename(f))]
        needed = [SEED_LOG_NAME]
        if any(e.master.dtype != e.param.dtype for e in self.es_params.entries):
            needed.append(MASTER_WEIGHTS_NAME)  # the fp32 master of a 16-bit model
        if self.anchor is not None:
            needed.append(ANCHOR_WEIGHTS_NAME)  # theta_0 (awd_lambda > 0 or log_parameter_drift)
        missing += [name for name in needed if not _present_or_sharded(folder, name)]
        if resume:
            missing += [name for name in (TRAINER_STATE_NAME, SCHEDULER_NAME) if not is_present(folder, name)]
            if not any(n.startswith("rng_state") and n.endswith(".pth") for n in os.listdir(folder)):
                missing.append("rng_state.pth")
            optimizer_files = [n for n in os.listdir(folder) if n == OPTIMIZER_NAME
                               or (n.startswith("optimizer.rank") and n.endswith(".pt"))]  # ZeRO-3: per process
            if self.args.es_optimizer == "torch" and not optimizer_files:
                missing.append(OPTIMIZER_NAME)
        return missing

    def _check_checkpoint(self, folder: str, resume: bool = True) -> SeedLog:
        """Refuse, before anything is loaded, a checkpoint this run cannot continue exactly; returns its seed log.

        Raises:
            ValueError: naming the missing files, a seed log that is not steps 1..N of ``trainer_state.json``, or (to
                resume) the :data:`RESUME_HEADER_FIELDS` / :data:`RESUME_SETTINGS` value that differs.
        """
        saved = self._check_checkpoint_files(folder, resume)
        if resume:  # everything else (max_steps, logging, the engine, the number of processes...) may change
            self._check_resume_settings(folder, saved.header)
        return saved

    def _check_checkpoint_files(self, folder: str, resume: bool = True) -> SeedLog:
        """The completeness part of :meth:`_check_checkpoint` (everything but the settings); a checkpoint a kill left
        half-written fails here (``trainer_state.json`` is written last).

        Raises:
            ValueError: naming the missing files or the steps that disagree.
        """
        if not os.path.isdir(folder):
            raise ValueError(f"Cannot resume from {folder!r}: it is not a folder.")
        missing = self._missing_checkpoint_files(folder, resume)
        if missing:
            raise ValueError(f"Cannot {'resume from' if resume else 'load'} the checkpoint {folder!r}: it is "
                             f"incomplete, it holds no {' and no '.join(missing)} (copied with file patterns, or "
                             "written by a save that did not finish?). Use a complete checkpoint.")
        saved = SeedLog.load(os.path.join(folder, SEED_LOG_NAME))
        if not resume:
            return saved
        try:
            with open(os.path.join(folder, TRAINER_STATE_NAME)) as f:
                global_step = int(json.load(f)["global_step"])
        except (ValueError, KeyError, TypeError) as error:  # e.g. truncated by a kill while it was written
            raise ValueError(f"Cannot resume from {folder!r}: its {TRAINER_STATE_NAME} is unreadable ({error!r}); "
                             "the checkpoint is incomplete.") from error
        if saved.global_step != global_step:
            raise ValueError(f"Cannot resume from {folder!r}: its {TRAINER_STATE_NAME} is at step {global_step} but "
                             f"its {SEED_LOG_NAME} ends at step {saved.global_step}: the seed log belongs to another "
                             "point of the run (or another run).")
        return saved

    def _latest_complete_checkpoint(self) -> str | None:
        """``resume_from_checkpoint="latest"``: the newest ``checkpoint-N`` of ``output_dir`` that
        :meth:`_check_checkpoint_files` accepts (incomplete ones skipped with a warning), or ``None`` to start fresh.
        Different settings are not skipped: :meth:`_check_checkpoint` refuses them afterwards."""
        choice = [None]
        if self.accelerator.is_main_process:
            output_dir = self.args.output_dir
            names = os.listdir(output_dir) if os.path.isdir(output_dir) else []
            folders = sorted(((step, os.path.join(output_dir, name)) for name in names
                              if (step := _checkpoint_step(name)) is not None
                              and os.path.isdir(os.path.join(output_dir, name))), reverse=True)
            for _, folder in folders:
                try:
                    self._check_checkpoint_files(folder)
                except (ValueError, OSError) as error:
                    logger.warning("resume_from_checkpoint=%r: skipping %s, which is incomplete (killed while it was "
                                   "written?): %s", AUTO_RESUME, folder, error)
                    continue
                choice[0] = folder
                break
            if choice[0] is not None:
                logger.info("resume_from_checkpoint=%r: resuming from %s.", AUTO_RESUME, choice[0])
            else:
                logger.info("resume_from_checkpoint=%r: no complete checkpoint in %s, starting a new run.",
                            AUTO_RESUME, output_dir)
        if self.accelerator.num_processes > 1:
            from accelerate.utils import broadcast_object_list

            broadcast_object_list(choice, from_process=0)  # every process resumes from the main process's choice
        return choice[0]

    def _check_resume_settings(self, folder: str, saved: dict) -> None:
        """Compare a checkpoint's seed-log header with this run's (see :meth:`_check_checkpoint`).

        Raises:
            ValueError: naming every setting that differs, with the checkpoint's value and this run's.
        """
        current = self.seed_log.header
        saved = dict(saved)
        if "perturbation" not in saved and "parameters" in saved:  # a log without the key: read it from the header
            saved["perturbation"] = header_perturbation(saved).describe()
        differences = [(field, saved[key], current.get(key)) for key, field in RESUME_HEADER_FIELDS.items()
                       if key in saved and saved[key] != current.get(key)]
        settings, now = saved.get("run_settings", {}), current.get("run_settings", {})
        settings = {**self.stability.settings_before_they_were_logged(settings), **settings}
        differences += [(name, settings[name], now.get(name)) for name in settings
                        if name in now and settings[name] != now[name]]
        if saved.get(HEADER_KEY) != current.get(HEADER_KEY):  # the base: a header without the key is unquantized
            differences.append(("quantization_config (the base model's)", saved.get(HEADER_KEY),
                                current.get(HEADER_KEY)))
        if differences:
            listed = "; ".join(f"{field} (checkpoint: {theirs!r}, this run: {ours!r})"
                               for field, theirs, ours in differences)
            raise ValueError(f"Cannot resume from {folder!r}: these settings differ from the checkpoint's: {listed}. "
                             "The resumed run would not continue the checkpoint's run (and its seed log would not "
                             "replay): resume with the checkpoint's values, or start a new run.")

    # ------------------------------------------------------------------ paths that load other weights
    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        super()._load_from_checkpoint(resume_from_checkpoint, model)
        self._load_es_state(resume_from_checkpoint)

    def _load_optimizer_and_scheduler(self, checkpoint):
        """``es_optimizer="es"``: load only the scheduler and set its learning rate (the optimizer never steps);
        ``"torch"``: as ``Trainer``."""
        if checkpoint is None or self.args.es_optimizer != "es":
            return super()._load_optimizer_and_scheduler(checkpoint)
        self.lr_scheduler.load_state_dict(torch.load(os.path.join(checkpoint, SCHEDULER_NAME), weights_only=True))
        for group, learning_rate in zip(self.optimizer.param_groups, self.lr_scheduler.get_last_lr(), strict=True):
            group["lr"] = learning_rate

    def _load_best_model(self):
        """``load_best_model_at_end``: the best checkpoint's weights with its ES state (master, theta_0, seed log); the
        optimizer's state stays at the last step, as in ``Trainer``.

        Raises:
            ValueError: if the best checkpoint lacks a file its ES state needs (:meth:`_missing_checkpoint_files`).
        """
        best = self.state.best_model_checkpoint
        self._check_checkpoint(best, resume=False)
        if self.is_deepspeed_enabled:  # Trainer would read a DeepSpeed engine checkpoint, which ES never writes
            self._load_deepspeed_checkpoint(best)
        else:
            super()._load_best_model()
            self._load_es_state(best)
        logger.info("Loaded the best model (step %d) with its ES state.", self.seed_log.global_step)

    def call_model_init(self, trial=None):
        """``model_init`` (``hyperparameter_search``): a new model, for which the ES state is rebuilt once the trial's
        settings are in ``args`` (:meth:`_hp_search_setup`), before a checkpoint is loaded."""
        model = super().call_model_init(trial)
        self._es_state_is_stale = True
        return model

    def _hp_search_setup(self, trial):
        super()._hp_search_setup(trial)
        if getattr(self, "_es_state_is_stale", False):
            self._es_state_is_stale = False
            self.population.close()
            self._init_es_state()

    def _load_es_state(self, folder: str) -> None:
        """Load the checkpoint's ES master, anchor and seed log, whatever number of processes wrote it.

        Raises:
            ValueError: if the checkpoint lacks the fp32 master of a 16-bit model (or, see
                :meth:`_check_checkpoint`, another ES file), or its seed log has missing steps.
        """
        saved_log = self._check_checkpoint(folder, resume=False)
        layout = {e.name: (e.start, e.param.numel()) for e in self.es_params.entries}  # the elements this process reads
        masters = read_flat_ranges(folder, MASTER_WEIGHTS_NAME, layout)
        if masters is not None:
            self.es_params.load_master_state_dict(masters)
        elif any(e.master.dtype != e.param.dtype for e in self.es_params.entries):
            raise ValueError(f"Cannot resume from {folder!r}: it holds no {MASTER_WEIGHTS_NAME} (the fp32 master of "
                             "this 16-bit model); the checkpoint is incomplete. Resume from an earlier checkpoint.")
        else:  # the master has the model's dtype: the model just loaded is the master
            self.es_params.refresh_master_from_model_()
        if self.anchor is not None:
            self._adopt_checkpoint_anchor(read_flat_ranges(folder, ANCHOR_WEIGHTS_NAME, layout))
        self.seed_log.records = saved_log.records
        self._sync_engine_weights()  # use_vllm: the engine computes with the loaded weights

    def _adopt_checkpoint_anchor(self, saved: dict[str, torch.Tensor]) -> None:
        """Use the checkpoint's theta_0: keep the current anchor if it holds the same values, else hold ``saved``."""
        same = all(torch.equal(saved[n].reshape(-1), self.anchor[n].reshape(-1).to(saved[n].dtype))
                   for n in self.anchor)
        if not same:  # decay toward the anchor of the run it continues, whatever model this run started from
            shapes = {e.name: e.param.shape for e in self.es_params.entries}
            self.strategy.anchor = MemoryAnchor({n: saved[n].view(shapes[n]) for n in self.anchor})

    def _load_deepspeed_checkpoint(self, folder: str) -> None:
        """Resume under DeepSpeed from this trainer's checkpoint (the gathered model, not a DeepSpeed engine
        checkpoint), to the same weights as an uninterrupted run.

        Raises:
            ValueError: for a PEFT model, a checkpoint without the gathered model, or (``es_optimizer='torch'``) an
                optimizer state written by another number of processes.
        """
        rank, world = self.accelerator.process_index, self.accelerator.num_processes
        unwrapped = self.accelerator.unwrap_model(self.model)
        if hasattr(unwrapped, "peft_config"):
            raise ValueError("Resuming a PEFT model under DeepSpeed is not supported: start a new run from the "
                             "checkpoint's adapter, or resume without DeepSpeed.")
        files = checkpoint_weight_map(folder)  # model.safetensors or its shards, written by every ZeRO stage
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
                e.param.view(-1).copy_(flat[e.start : e.start + e.param.numel()])  # this process's partition (ZeRO-3)
        self._load_es_state(folder)
        if optimizer_path is not None:
            self.optimizer.load_state_dict(torch.load(optimizer_path, weights_only=True))
        self._sync_model_view()
