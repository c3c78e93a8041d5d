"""ESTrainer's checkpoint I/O: the seed log beside every saved model, the fp32 master and theta_0 in checkpoints (one
file, or one shard per process under ZeRO-3), and resume to the weights of an uninterrupted run.

A mixin of :class:`~trl_es.trainer.es_trainer.ESTrainer` (it reads the trainer's ES state: ``es_params``, ``anchor``,
``seed_log``, ``population``); every file goes through :mod:`trl_es.files` (one writer, complete or absent).
"""

from __future__ import annotations

import os

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers.utils import logging

from ..es.anchor import FileAnchor, MemoryAnchor, checkpoint_weight_map
from ..es.seedlog import SEED_LOG_NAME, SeedLog
from ..files import SAVED_MODEL_FILES, atomic_path, require_files
from .distributed import read_flat_ranges

logger = logging.get_logger(__name__)

MASTER_WEIGHTS_NAME = "es_master.safetensors"
ANCHOR_WEIGHTS_NAME = "es_anchor.safetensors"


class ESCheckpointMixin:
    """Saving and resuming an ES run (see the module docstring)."""

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
        """Save the model as ``Trainer`` does, plus the seed log (``es_seed_log.jsonl``); in a checkpoint
        (``_internal_call``, the first thing ``Trainer._save_checkpoint`` writes) also the ES state: the fp32 master
        and theta_0 (:meth:`_save_es_state`), so they are on disk before ``trainer_state.json`` marks the checkpoint
        and old checkpoints are rotated away.

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

    def _keep_anchor_out_of(self, folder: str) -> None:
        """Before writing a model into ``folder``: if theta_0 is read from a file there, hold it in memory first (the
        write would replace the file theta_0 is read from)."""
        if isinstance(self.anchor, FileAnchor) and os.path.abspath(folder) in self.anchor.folders:
            logger.warning("Saving into %s, which holds the file theta_0 is read from: theta_0 is now kept in memory.",
                           folder)
            self.anchor = self.anchor.materialize()

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
        elif any(e.master.dtype != e.param.dtype for e in self.es_params.entries):
            raise ValueError(f"Cannot resume from {folder!r}: it holds no {MASTER_WEIGHTS_NAME} (the fp32 master of "
                             "this 16-bit model); the checkpoint is incomplete. Resume from an earlier checkpoint.")
        else:  # the master has the model's dtype: the model just loaded is the master
            self.es_params.refresh_master_from_model_()
        if self.anchor is not None:
            anchor = read_flat_ranges(folder, ANCHOR_WEIGHTS_NAME, layout)
            if anchor is not None:
                self._adopt_checkpoint_anchor(anchor)
        if os.path.exists(log_path):
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
