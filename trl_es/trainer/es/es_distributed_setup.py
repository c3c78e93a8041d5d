"""ESTrainer's multi-process preparation: population parallelism without DDP, DeepSpeed without a DeepSpeed
optimizer (ZeRO-3: sharded ES), identical replicas, and the exact count of what travels between processes.

A mixin of :class:`~trl_es.trainer.es.es_trainer.ESTrainer` (see ``docs/scaling.md``).
"""

from __future__ import annotations

import warnings

import torch
from transformers.utils import logging

from ...es.anchor import checkpoint_files, make_anchor
from ...fingerprint import tensors_fingerprint
from ..distributed import (
    ES_DEEPSPEED_NOTE,
    broadcast_tensors_,
    es_deepspeed_config,
    fingerprints_agree,
    is_zero3_param,
    release_gathered_,
)


logger = logging.get_logger(__name__)


class ESDistributedMixin:
    """Preparing the model and optimizer for one or several processes (see the module docstring)."""

    sharded = False  # whether the trained parameters are DeepSpeed ZeRO-3 partitions (sharded ES, docs/scaling.md)

    def _set_es_model_params(self, params: list) -> None:
        """Hold ``params`` (the model's trained parameters) and whether they are ZeRO-3 partitions (:attr:`sharded`):
        set where they are chosen or rebound, and again after ``deepspeed.initialize`` partitions them."""
        self._es_model_params = params
        self.sharded = any(is_zero3_param(p) for p in params)

    def _prepare_for_training(self, max_steps, train_dataloader, resume_from_checkpoint):
        """Prepare the model without gradient machinery (ES has no backward pass); returns ``(model, dataloader)``."""
        if not self.is_deepspeed_enabled and self.accelerator.num_processes == 1:
            prepared = super()._prepare_for_training(max_steps, train_dataloader, resume_from_checkpoint)
            self._rebind_es_params()
            return prepared
        if self._created_lr_scheduler:
            self.lr_scheduler = None
            self._created_lr_scheduler = False
        if self.is_deepspeed_enabled:
            model = self._prepare_deepspeed_engine(max_steps)
            self.create_optimizer()  # Trainer's torch optimizer over the fp32 masters, never given to DeepSpeed
        else:
            # no DDP wrapper: it would broadcast the weights and allocate gradient buckets never used
            model = self.accelerator.prepare_model(self.model, evaluation_mode=True)
            self.create_optimizer()
            self.optimizer = self.accelerator.prepare(self.optimizer)
        self.create_scheduler(num_training_steps=max_steps)
        self.model_wrapped = model
        if not self.sharded:
            self._rebind_es_params()
            self._check_replicas_identical()  # population parallelism needs identical replicas
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
        """``accelerator.prepare(model)`` under DeepSpeed with the ES config (no optimizer); built once."""
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
        self._set_es_model_params(self._es_model_params)  # ZeRO-3 partitions exist from here on
        if self.sharded:  # rebuild the ES state on this process's partitions (param.ds_tensor)
            self._build_strategy(self.strategy.population, self.strategy.noise)  # the partitions; same noise
            self.accelerator.unwrap_model(engine).register_forward_pre_hook(self._count_forward)
        return engine

    def _rebind_es_params(self) -> None:
        """Point the ES entries at the model's current tensors (preparing may move them), keeping the masters.

        Raises:
            RuntimeError: if a trained parameter changed shape.
        """
        named = dict(self.accelerator.unwrap_model(self.model).named_parameters())
        moved = False
        for entry in self.es_params.entries:
            current = named[entry.name].data
            # accelerate's device is cpu:0 or cuda:r: model.to(device) allocates new tensors even on the same device
            if current.data_ptr() != entry.param.data_ptr():
                self.es_params.rebind_(entry.name, current)
                moved = True
        self._set_es_model_params([named[entry.name] for entry in self.es_params.entries])
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
        """Make every process hold rank 0's weights, masters and anchor (as DDP would), warning if they differed."""
        unwrapped = self.accelerator.unwrap_model(self.model)
        named = {f"model.{k}": t for k, t in unwrapped.state_dict().items() if isinstance(t, torch.Tensor)}
        named.update({f"master.{k}": t for k, t in self.es_params.master_state_dict().items()})
        digest = tensors_fingerprint(named, digest_size=16)  # 16 bytes travel, not the weights
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
        self.es_params.write_master_to_model_()
        if self.anchor is not None:  # theta_0 is now process 0's initial weights
            files = checkpoint_files(unwrapped) if self.args.anchor_storage != "memory" else []
            self.strategy.anchor = make_anchor(self.es_params, self.args.anchor_storage, files)

    def _sync_model_view(self) -> None:
        """Under ZeRO-3, drop gathered copies of the trained parameters so the next forward sees the partitions."""
        if self.sharded:
            release_gathered_(self._es_model_params)

    def _record_param_gathers(self, forward_calls: int) -> None:
        """Under ZeRO-3 on several processes: log ``comm/param_gather_bytes`` (an upper bound) of the iteration's
        ``forward_calls`` and count them, with the ``synced_gpus`` all-reduces, into the iteration's ``comm/bytes``."""
        unwrapped = self.accelerator.unwrap_model(self.model)
        full = sum(int(p.ds_numel) * p.element_size() for p in unwrapped.parameters() if is_zero3_param(p))
        gathered = float(forward_calls * full)  # one full gather per forward (persistent ones: once per member)
        self._metrics["comm/param_gather_bytes"].append(gathered)
        self._comm_bytes += 4 * forward_calls + gathered  # generate(synced_gpus=True): one float32 all-reduce per step
