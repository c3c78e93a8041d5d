"""ESTrainer's checkpoint I/O: the seed log beside every saved model, the fp32 master and theta_0 in checkpoints (one
file, or one shard per process under ZeRO-3), and resume to the weights of an uninterrupted run.

Every ``Trainer`` path that puts other weights into the model keeps the ES state (master, anchor, seed log) in step
with them: resuming (:meth:`ESCheckpointMixin._load_from_checkpoint`, and under DeepSpeed
``_load_deepspeed_checkpoint``), ``load_best_model_at_end`` (:meth:`ESCheckpointMixin._load_best_model`) and a model
re-created by ``model_init`` (``hyperparameter_search``; see :meth:`ESCheckpointMixin.call_model_init`). A checkpoint
is checked before anything is loaded (:meth:`ESCheckpointMixin._check_checkpoint`): every file it needs, a seed log
of steps 1..N that ends where ``trainer_state.json`` does, and the settings the run continues with.

Preemption: with ``ESConfig(resume_from_checkpoint="latest")`` a job relaunched by ``torchrun --max-restarts N`` (or
any scheduler) resumes by itself from the newest *complete* checkpoint of ``output_dir``
(:meth:`ESCheckpointMixin._latest_complete_checkpoint`): ``Trainer._save_checkpoint`` writes ``checkpoint-N`` in place
and ``trainer_state.json`` last, so a kill mid-write leaves a folder that the completeness check
(:meth:`ESCheckpointMixin._check_checkpoint_files`) refuses, and the one before is used.

A mixin of :class:`~trl_es.trainer.es.es_trainer.ESTrainer` (it reads the trainer's ES state: ``es_params``, ``anchor``,
``seed_log``, ``population``); every file goes through :mod:`trl_es.files` (one writer, complete or absent).
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
    """``name`` (``es_master.safetensors``), or ZeRO-3's per-process shards of it: every rank ``0..W-1`` of one
    world size ``W``, each a non-empty file (a process killed before writing its shard leaves the set incomplete)."""
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
        """``Trainer.train``, then the seed log is written to ``output_dir`` (a whole run in a few kilobytes).

        A checkpoint to resume from (``resume_from_checkpoint=True``: the last one in ``output_dir``) is checked
        first, before anything is loaded (:meth:`_check_checkpoint`). Whatever the population backend installed in
        the model (the low-rank adapters' hooks) is removed at the end, also when training raises.

        Called without ``resume_from_checkpoint`` (``None``; ``False`` starts fresh), the config's
        ``resume_from_checkpoint`` is used: a checkpoint folder, or ``"latest"`` (:data:`AUTO_RESUME`): the newest
        complete checkpoint of ``output_dir``, skipping (with a warning) newer ones a kill left incomplete, or a fresh
        start if there is none (:meth:`_latest_complete_checkpoint`; every process resumes from the one the main
        process chose). A job relaunched after preemption (``torchrun --max-restarts N``) thus resumes by itself.

        Raises:
            ValueError: if the checkpoint is incomplete, its seed log has missing steps or ends elsewhere than its
                ``trainer_state.json``, or this run's settings differ from the checkpoint's where the run's
                trajectory depends on them (:meth:`_check_checkpoint`).
        """
        if resume_from_checkpoint is None:
            resume_from_checkpoint = getattr(self.args, "resume_from_checkpoint", None) or None
        if resume_from_checkpoint == AUTO_RESUME:
            resume_from_checkpoint = self._latest_complete_checkpoint()
        if resume_from_checkpoint is True:
            resume_from_checkpoint = get_last_checkpoint(self.args.output_dir) or True  # None: Trainer says so
        if isinstance(resume_from_checkpoint, (str, os.PathLike)):
            resume_from_checkpoint = os.fspath(resume_from_checkpoint)
            self._check_checkpoint(resume_from_checkpoint)
        try:
            output = super().train(resume_from_checkpoint, trial, **kwargs)
        finally:
            self.population.close()
        if self.args.should_save:
            os.makedirs(self.args.output_dir, exist_ok=True)
            self.seed_log.save(os.path.join(self.args.output_dir, SEED_LOG_NAME))
        return output

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False):
        """Save the model as ``Trainer`` does, plus the seed log (``es_seed_log.jsonl``) and, outside a checkpoint,
        the model card (``README.md``, :meth:`create_model_card`'s, after ``save_pretrained``, whose PEFT adapter
        card it replaces); in a checkpoint (``_internal_call``, the first thing ``Trainer._save_checkpoint`` writes)
        also the ES state: the fp32 master and theta_0 (:meth:`_save_es_state`), so they are on disk before
        ``trainer_state.json`` marks the checkpoint and old checkpoints are rotated away.

        Under ZeRO-3 ``Trainer`` gathers the partitions into one ``from_pretrained``-loadable model (DeepSpeed's
        ``stage3_gather_16bit_weights_on_model_save``, which ES turns on by default); every process must call this.

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
        if _internal_call:
            self._save_es_state(output_dir)
        else:  # a checkpoint's card is written in output_dir by _save_checkpoint; a saved model gets its own
            write_model_card(self, output_dir, model_card_name(self.args, output_dir))

    def create_model_card(self, model_name: str | None = None, dataset_name: str | None = None,
                          tags: str | list[str] | None = None) -> None:
        """TRL's ``create_model_card``: ``output_dir/README.md``, with the ES settings, the seed-log note and the
        papers to cite (:func:`~trl_es.trainer.es.model_card.write_model_card`; main process only).

        Args:
            model_name (`str`, *optional*): The trained model's name.
            dataset_name (`str`, *optional*): The training dataset's hub id; default: the train dataset's, where it
                can be told (:func:`~trl_es.trainer.es.model_card.hub_dataset_id`).
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
        """The ES state of a checkpoint: the fp32 master (when it differs in dtype from the model's weights, which are
        then its rendering) and theta_0, each written atomically by the main process, or under ZeRO-3 one shard per
        process (:meth:`_save_es_shards`)."""
        if self.sharded:
            self._save_es_shards(folder)
            return
        if not self.args.should_save:
            return
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

    # ------------------------------------------------------------------ what a checkpoint must hold
    def _missing_checkpoint_files(self, folder: str, resume: bool = True) -> list[str]:
        """The files of ``folder`` that this run needs and that are absent (or empty).

        Always: the model (``model.safetensors``, or its index and every shard it lists, or a PEFT adapter) and its
        config, the seed log, the fp32 master (``es_master.safetensors``, or ZeRO-3 shards of it) when it differs in
        dtype from the model's weights, theta_0 (``es_anchor.safetensors``) when this run holds one (``awd_lambda >
        0`` or ``log_parameter_drift``). To resume (``resume=True``) also ``trainer_state.json`` (the step),
        ``scheduler.pt`` (the learning rate's place in its schedule), an RNG state (``rng_state*.pth``) and, with
        ``es_optimizer="torch"``, the optimizer's state (``optimizer.pt``, or ZeRO-3's per-process files).
        """
        missing = missing_files(folder, SAVED_MODEL_FILES)
        index = os.path.join(folder, "model.safetensors.index.json")
        if not is_present(folder, "model.safetensors") and os.path.isfile(index):
            shards = sorted(set(checkpoint_weight_map(folder).values()))
            missing += [os.path.basename(f) for f in shards if not is_present(folder, os.path.basename(f))]
        needed = [SEED_LOG_NAME]
        if any(e.master.dtype != e.param.dtype for e in self.es_params.entries):
            needed.append(MASTER_WEIGHTS_NAME)
        if self.anchor is not None:
            needed.append(ANCHOR_WEIGHTS_NAME)
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
        """Refuse, before anything is loaded, a checkpoint this run cannot continue exactly.

        Checked: every file the run needs is there (:meth:`_missing_checkpoint_files`); the seed log holds steps
        1..N (:meth:`SeedLog.load`) and, to resume, ends at the ``global_step`` of ``trainer_state.json``; and, to
        resume, every setting that :func:`trl_es.replay` or the resumed run reads equals the checkpoint's:
        :data:`RESUME_HEADER_FIELDS` and the seed log's ``run_settings`` (:data:`RESUME_SETTINGS`, with
        ``es_optimizer="torch"`` also :data:`TORCH_OPTIMIZER_SETTINGS`, and the reward functions' names). Logs
        written before a key existed are compared on the keys they hold. Everything else may change on resume
        (``max_steps``, ``num_train_epochs``, ``output_dir``, logging, saving and evaluation settings, the generation
        engine, ``use_vllm``, ``anchor_storage``, ``success_threshold``, the number of processes where the
        checkpoint allows it...).

        Returns:
            `SeedLog`: The checkpoint's seed log.

        Raises:
            ValueError: naming the missing files, the missing or extra steps, or the setting whose value differs
                (the checkpoint's value and this run's).
        """
        saved = self._check_checkpoint_files(folder, resume)
        if resume:
            self._check_resume_settings(folder, saved.header)
        return saved

    def _check_checkpoint_files(self, folder: str, resume: bool = True) -> SeedLog:
        """The completeness part of :meth:`_check_checkpoint` (everything but the settings): the folder holds every
        file the run needs, its seed log holds steps 1..N and, to resume, ``trainer_state.json`` is readable and at
        step N. What a kill during a checkpoint write leaves fails here (``trainer_state.json`` is written last).

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
        :meth:`_check_checkpoint_files` accepts, or ``None`` (start fresh) if there is none.

        A newer folder that is incomplete (a process killed while writing it) is skipped with a warning naming it and
        why. The main process decides and broadcasts its choice, so every process resumes from the same checkpoint.
        (Checkpoints whose *settings* differ from this run's are not skipped: :meth:`_check_checkpoint` refuses them
        afterwards, naming the setting.)
        """
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

            broadcast_object_list(choice, from_process=0)
        return choice[0]

    def _check_resume_settings(self, folder: str, saved: dict) -> None:
        """Compare a checkpoint's seed-log header with this run's (see :meth:`_check_checkpoint`).

        Raises:
            ValueError: naming every setting that differs, with the checkpoint's value and this run's.
        """
        current = self.seed_log.header
        saved = dict(saved)
        if "perturbation" not in saved and "parameters" in saved:  # logs written before the key: its backend says
            saved["perturbation"] = header_perturbation(saved).describe()
        differences = [(field, saved[key], current.get(key)) for key, field in RESUME_HEADER_FIELDS.items()
                       if key in saved and saved[key] != current.get(key)]
        settings, now = saved.get("run_settings", {}), current.get("run_settings", {})
        differences += [(name, settings[name], now.get(name)) for name in settings
                        if name in now and settings[name] != now[name]]
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
        """With ``es_optimizer="es"`` the optimizer never steps: only the scheduler's state is loaded and the
        learning rate it gives the next iteration is set (so a checkpoint's optimizer file, or its absence, makes no
        difference). ``"torch"``: as ``Trainer`` (its file is checked by :meth:`_check_checkpoint`)."""
        if checkpoint is None or self.args.es_optimizer != "es":
            return super()._load_optimizer_and_scheduler(checkpoint)
        self.lr_scheduler.load_state_dict(torch.load(os.path.join(checkpoint, SCHEDULER_NAME), weights_only=True))
        for group, learning_rate in zip(self.optimizer.param_groups, self.lr_scheduler.get_last_lr(), strict=True):
            group["lr"] = learning_rate

    def _load_best_model(self):
        """``load_best_model_at_end``: the best checkpoint's weights, and with them its ES state: the master, theta_0
        and the seed log up to the best step, so that the saved model replays from its seed log and further training
        continues from the best weights. (With ``es_optimizer="torch"`` the optimizer's state stays at the last step,
        as in ``Trainer``.)

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
        """The checkpoint's ES master, anchor and seed log, whatever number of processes wrote it (one file each, or
        ZeRO-3's per-process shards): every process reads exactly its elements (:func:`read_flat_ranges`).

        Raises:
            ValueError: if the checkpoint lacks the fp32 master of a 16-bit model (or, see
                :meth:`_check_checkpoint`, another ES file), or its seed log has missing steps.
        """
        saved_log = self._check_checkpoint(folder, resume=False)
        layout = {e.name: (e.start, e.param.numel()) for e in self.es_params.entries}
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
        """Use the checkpoint's theta_0: keep the current anchor where it holds the same values (e.g. read from the
        base model's file), else hold the checkpoint's values in memory (a resumed run decays toward the anchor of
        the run it continues, whatever model it was started from)."""
        same = all(torch.equal(saved[n].reshape(-1), self.anchor[n].reshape(-1).to(saved[n].dtype))
                   for n in self.anchor)
        if not same:
            shapes = {e.name: e.param.shape for e in self.es_params.entries}
            self.strategy.anchor = MemoryAnchor({n: saved[n].view(shapes[n]) for n in self.anchor})

    def _load_deepspeed_checkpoint(self, folder: str) -> None:
        """Resume under DeepSpeed from a checkpoint written by this trainer, to the same weights as an uninterrupted
        run.

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
        files = checkpoint_weight_map(folder)
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
