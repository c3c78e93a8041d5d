"""The SFT side of parallel averaging: TRL's SFTTrainer, driven one optimizer step at a time on a shared model.

:class:`SFTStep` takes ``trl.SFTTrainer``'s data pipeline and loss, with a **separate** optimizer and scheduler (its
moments never mix with the host trainer's); the host (GRPO or ES) decides when a step happens.
"""

from __future__ import annotations

import os
from collections import defaultdict

import torch
from transformers import Trainer, TrainingArguments
from trl import SFTConfig, SFTTrainer

from ...files import atomic_path


__all__ = ["SFT_STATE_NAME", "SFTStep", "check_averaging_fields", "sft_config_from"]

#: File of a checkpoint holding the SFT side's optimizer and scheduler states.
SFT_STATE_NAME = "sft_optimizer.pt"

#: TrainingArguments fields the SFT side copies from the host's config: the optimizer, schedule, precision, seed.
HOST_FIELDS = (
    "optim", "optim_args", "adam_beta1", "adam_beta2", "adam_epsilon", "weight_decay", "lr_scheduler_type",
    "lr_scheduler_kwargs", "warmup_steps", "bf16", "fp16", "use_cpu", "seed", "gradient_accumulation_steps",
    "activation_checkpointing", "activation_checkpointing_kwargs",
)
_MISSING = object()


def check_averaging_fields(config: TrainingArguments, update_weight_name: str) -> None:
    """Validate a parallel-averaging config's two weights (``update_weight_name``: ``"rl_weight"`` or ``"es_weight"``,
    and ``sft_weight``) and its ``sft_*`` fields.

    Raises:
        ValueError: naming the field: a weight that is not a finite number >= 0, both weights 0, a learning rate
            <= 0, a batch size or maximum length < 1, a negative clipping norm.
    """
    import math

    for name in (update_weight_name, "sft_weight"):
        value = getattr(config, name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            raise ValueError(f"{name} must be a finite number >= 0, got {value!r}.")
    if getattr(config, update_weight_name) == 0 and config.sft_weight == 0:  # the average would be the snapshot
        raise ValueError(f"{update_weight_name} and sft_weight are both 0: no update would remain.")
    if config.sft_learning_rate is not None and not config.sft_learning_rate > 0:
        raise ValueError(f"sft_learning_rate must be > 0, got {config.sft_learning_rate}.")
    batch = config.sft_per_device_train_batch_size
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ValueError(f"sft_per_device_train_batch_size must be an integer >= 1, got {batch!r}.")
    if config.sft_max_length is not None and config.sft_max_length < 1:
        raise ValueError(f"sft_max_length must be None or >= 1, got {config.sft_max_length}.")
    if config.sft_max_grad_norm is not None and config.sft_max_grad_norm < 0:
        raise ValueError(f"sft_max_grad_norm must be None or >= 0, got {config.sft_max_grad_norm}.")


def sft_config_from(
    host: TrainingArguments,
    learning_rate: float,
    per_device_train_batch_size: int,
    max_length: int | None,
    completion_only_loss: bool | None,
    max_grad_norm: float,
) -> SFTConfig:
    """The SFT side's ``trl.SFTConfig``: ``host``'s :data:`HOST_FIELDS` (a ``GRPOConfig`` or ``ESConfig``) and the
    given SFT settings (``sft_*``'s meaning; ``max_grad_norm`` 0: no clipping)."""
    kwargs = {name: getattr(host, name) for name in HOST_FIELDS}  # otherwise the same optimizer as the host's
    if kwargs["lr_scheduler_kwargs"] is None:
        kwargs["lr_scheduler_kwargs"] = {}
    return SFTConfig(
        output_dir=os.path.join(host.output_dir, "sft"),
        learning_rate=learning_rate,
        per_device_train_batch_size=per_device_train_batch_size,
        max_length=max_length,
        completion_only_loss=completion_only_loss,
        max_grad_norm=max_grad_norm,
        max_steps=host.max_steps,
        report_to="none",  # the host logs and saves
        save_strategy="no",
        logging_strategy="no",
        eval_strategy="no",
        disable_tqdm=True,
        **kwargs,
    )


class SFTStep:
    """One supervised fine-tuning step at a time: TRL's SFTTrainer data pipeline and ``"nll"`` loss, its own optimizer;
    ``step(t)`` takes SFT batch ``t``, a fixed function of ``t`` and the seed.

    Args:
        model (`PreTrainedModel`): The model, shared with the host trainer.
        processing_class (`PreTrainedTokenizerBase`): Its tokenizer.
        train_dataset (`datasets.Dataset`): Any dataset SFTTrainer accepts (prompt-completion rows).
        args (`trl.SFTConfig`): See :func:`sft_config_from`.
        num_training_steps (`int`, *optional*): The schedule's length; ``None``: call :meth:`create_scheduler`
            before the first step.
        targets (`list[tuple[torch.Tensor, torch.Tensor]]`, *optional*): ``(model parameter, optimized tensor)``
            pairs: the optimizer owns the second (ES's fp32 masters) and gets the first's gradients; ``None``:
            every trainable parameter (``SFTTrainer.create_optimizer()``).

    Attributes:
        trainer (`trl.SFTTrainer`): The SFT trainer (data, collator, loss, metrics); it never runs ``train()``.
        optimizer (`torch.optim.Optimizer`): The SFT side's own optimizer.
        lr_scheduler: Its scheduler.

    Raises:
        ValueError: if the dataset holds fewer examples than one batch after SFTTrainer's preparation.
    """

    def __init__(self, model, processing_class, train_dataset, args, num_training_steps: int | None = None,
                 targets=None):
        from accelerate.utils import is_peft_model

        self.model = model
        # both trainers patch forward with TRL's fused LM head (add_fused_lm_head), each with its own settings: the
        # SFT patch is kept aside and installed only for the SFT forward
        patched = model.get_base_model() if is_peft_model(model) else model  # where add_fused_lm_head writes
        host_forward = patched.__dict__.get("forward", _MISSING)
        self.trainer = SFTTrainer(model=model, args=args, train_dataset=train_dataset,
                                  processing_class=processing_class)
        self._patched = patched
        self._sft_forward = patched.__dict__.get("forward", _MISSING)
        self._restore_forward(host_forward)
        self.dataset = self.trainer.train_dataset  # tokenized, with completion-only labels
        self.batch_size = args.per_device_train_batch_size
        self.seed = args.seed
        self.max_grad_norm = args.max_grad_norm
        self.batches_per_epoch = len(self.dataset) // self.batch_size  # the last incomplete batch dropped
        if self.batches_per_epoch == 0:
            raise ValueError(f"The SFT dataset holds {len(self.dataset)} examples, fewer than one batch of "
                             f"{self.batch_size} (sft_per_device_train_batch_size).")
        self._epoch, self._order = None, None
        self.targets = list(targets) if targets is not None else None
        if self.targets is None:
            self.optimizer = self.trainer.create_optimizer()  # with the Trainer's weight-decay groups
        else:
            optimizer_cls, optimizer_kwargs = Trainer.get_optimizer_cls_and_kwargs(args, model)
            # parameters not in targets get no update
            groups = [{"params": [t for _, t in self.targets], "weight_decay": args.weight_decay}]
            self.optimizer = optimizer_cls(groups, **optimizer_kwargs)
            self.trainer.optimizer = self.optimizer
        self.lr_scheduler = None
        if num_training_steps is not None:
            self.create_scheduler(num_training_steps)
        self.trainer.current_gradient_accumulation_steps = 1  # set by Trainer's loop, read by training_step

    def create_scheduler(self, num_training_steps: int):
        """The SFT optimizer's scheduler over ``num_training_steps`` (``SFTTrainer.create_scheduler``), created once."""
        if self.lr_scheduler is None:
            self.lr_scheduler = self.trainer.create_scheduler(num_training_steps, optimizer=self.optimizer)
        return self.lr_scheduler

    def _restore_forward(self, forward) -> None:
        if forward is _MISSING:  # no instance attribute: the class's forward
            self._patched.__dict__.pop("forward", None)
        else:
            self._patched.forward = forward

    def batch_indices(self, step: int) -> list[int]:
        """The dataset rows of SFT batch ``step``."""
        # epoch step // B is randperm(n, seed + epoch) cut into B = n // batch_size batches
        epoch, position = divmod(int(step), self.batches_per_epoch)
        if epoch != self._epoch:  # a fresh permutation per epoch, from the seed alone: a resumed run gets the same
            generator = torch.Generator().manual_seed(self.seed + epoch)
            self._order = torch.randperm(len(self.dataset), generator=generator).tolist()
            self._epoch = epoch
        return self._order[position * self.batch_size : (position + 1) * self.batch_size]

    def parameters(self) -> list[torch.Tensor]:
        """The tensors the SFT optimizer updates."""
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    def step(self, step: int) -> dict[str, float]:
        """Take SFT step ``step`` at the model's current weights; gradients are ``None`` and the train/eval mode as
        before, afterwards.

        Returns:
            `dict[str, float]`: ``loss`` (the SFT loss before the step), ``grad_norm`` (before clipping),
            ``learning_rate`` (the one used), and SFTTrainer's metrics of the batch (``entropy``,
            ``mean_token_accuracy``, ``num_tokens``).
        """
        if self.lr_scheduler is None:
            raise RuntimeError("SFTStep.step() before create_scheduler(num_training_steps).")
        model = self.model
        batch = self.trainer.data_collator([self.dataset[i] for i in self.batch_indices(step)])
        model.zero_grad(set_to_none=True)  # the host's optimizer has stepped by now
        for tensor in self.parameters():
            tensor.grad = None
        was_training = model.training
        host_forward = self._patched.__dict__.get("forward", _MISSING)  # whatever the host runs with now
        self._restore_forward(self._sft_forward)
        try:
            # The SFT forward is not the one accelerate wrapped in autocast when the host prepared the model: apply the
            # host's mixed precision (bf16/fp16, copied into the SFT config) here, as the host's own forwards get it.
            with torch.enable_grad(), self.trainer.accelerator.autocast():
                loss = self.trainer.training_step(model, batch)  # SFTTrainer.compute_loss, then backward
        finally:
            self._restore_forward(host_forward)
            model.train(was_training)
        if self.targets is not None:
            for param, target in self.targets:
                # a parameter the loss does not reach gets a zero gradient: the optimizer still steps it
                grad = param.grad if param.grad is not None else torch.zeros_like(param)
                target.grad = grad.detach().to(dtype=target.dtype).reshape(target.shape)  # cast to the master's
        params = self.parameters()
        if self.max_grad_norm and self.max_grad_norm > 0:  # the norm logged is the one before clipping
            grad_norm = torch.nn.utils.clip_grad_norm_(params, self.max_grad_norm)
        else:
            grad_norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
        learning_rate = float(self.optimizer.param_groups[0]["lr"])  # the one this step uses
        self.optimizer.step()
        self.lr_scheduler.step()
        # no gradient left behind for the host's next backward to add to
        self.optimizer.zero_grad(set_to_none=True)
        model.zero_grad(set_to_none=True)
        metrics = {"loss": float(loss), "grad_norm": float(grad_norm), "learning_rate": learning_rate}
        # SFTTrainer's batch metrics (entropy, mean_token_accuracy, num_tokens)
        for key, values in self.trainer._metrics["train"].items():
            if values:
                metrics[key] = float(sum(values) / len(values))
        self.trainer._metrics["train"] = defaultdict(list)  # the next step's batch only
        return metrics

    def state_dict(self) -> dict:
        """The optimizer's and the scheduler's states (the batch order depends on the step index only)."""
        return {"optimizer": self.optimizer.state_dict(), "lr_scheduler": self.lr_scheduler.state_dict()}

    def save(self, folder: str) -> None:
        """:meth:`state_dict` to ``folder/SFT_STATE_NAME``, atomically; by the process that saves (``should_save``)."""
        with atomic_path(os.path.join(folder, SFT_STATE_NAME)) as tmp:
            torch.save(self.state_dict(), tmp)

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` (to resume)."""
        self.optimizer.load_state_dict(state["optimizer"])
        self.lr_scheduler.load_state_dict(state["lr_scheduler"])

    def load(self, folder: str, num_training_steps: int) -> None:
        """Resume from what :meth:`save` wrote to ``folder``, the scheduler over ``num_training_steps``."""
        self.create_scheduler(num_training_steps)
        self.load_state_dict(torch.load(os.path.join(folder, SFT_STATE_NAME), weights_only=True))
