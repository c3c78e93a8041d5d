"""Multi-process ES without the trainer: the launcher's world, ZeRO-3 partition bookkeeping, the DeepSpeed config for
ES, replica fingerprints, byte-counted collectives and the streaming dataset every process reads whole.

Population parallelism (members ``i % W == rank``, no weights travel) or sharded ES under ZeRO-3 (each process
perturbs and updates its own partition); see ``docs/scaling.md``.
"""

from __future__ import annotations

import itertools
import os
import pickle
import re
from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist
from torch import nn


ES_DEEPSPEED_NOTE = (
    "ES never steps a DeepSpeed optimizer: the optimizer and scheduler sections are removed, ZeRO stages 1 and 2 "
    "(which shard optimizer states and gradients, which ES does not have) run as stage 0, and ZeRO-3 runs without "
    "an optimizer (DeepSpeed's ZeRO-Offload parameter partitioning only)."
)


# ---------------------------------------------------------------------------------------------- the launcher's world
#: The environment variables a launcher sets to the number of processes (accelerate's list, in its order).
WORLD_SIZE_VARIABLES = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE", "WORLD_SIZE")
_CPU_WORLD_LOGGED = False


def launched_world_size() -> int:
    """The number of processes the launcher started (``WORLD_SIZE`` of torchrun / ``accelerate launch`` /
    ``deepspeed``, or an MPI launcher's), 1 when none is set."""
    for name in WORLD_SIZE_VARIABLES:
        value = os.environ.get(name, "")
        if value.strip().isdigit():
            return int(value)
    return 1


def accelerator_process_group_backend() -> str | None:
    """The process-group backend accelerate picks for this machine's accelerator (``"nccl"`` for CUDA, ...), or
    ``None`` (a CPU, or MPS: no process group unless ``use_cpu=True``)."""
    try:
        from accelerate.utils import is_torch_xla_available

        if is_torch_xla_available():
            return "xla"
        from accelerate.utils.imports import get_distributed_backend, get_torch_accelerator_backend
    except ImportError:  # accelerate < 1.12
        return "nccl" if torch.cuda.is_available() else None
    device_type, _ = get_torch_accelerator_backend()
    return get_distributed_backend(device_type) if device_type is not None else None


def _uses_configured_state(accelerator_config) -> bool:
    """``accelerator_config``'s ``use_configured_state`` in any form ``TrainingArguments`` takes (before its
    ``__post_init__``): ``None``, a dict, an ``AcceleratorConfig`` or a JSON file path."""
    if accelerator_config is None:
        return False
    if isinstance(accelerator_config, dict):
        return bool(accelerator_config.get("use_configured_state", False))
    if isinstance(accelerator_config, str):
        import json

        try:
            with open(accelerator_config) as f:
                return bool(json.load(f).get("use_configured_state", False))
        except (OSError, ValueError, AttributeError):
            return False
    return bool(getattr(accelerator_config, "use_configured_state", False))


def _accelerate_simple_launcher_asked_for_several() -> bool:
    """Whether accelerate's one-process ("simple") launcher started this process although asked for several."""
    env = os.environ
    # prepare_simple_launcher_cmd_env (accelerate 1.16): MASTER_PORT only for --num_processes > 1, but no WORLD_SIZE
    return (all(name in env for name in ("ACCELERATE_USE_CPU", "ACCELERATE_MIXED_PRECISION", "MASTER_PORT"))
            and not any(name in env for name in (*WORLD_SIZE_VARIABLES, "LOCAL_RANK", "RANK")))


def resolve_cpu_world(args) -> None:
    """Make a job launched with several processes on a machine without GPU run as those processes (set
    ``args.use_cpu = True``: one gloo group), before ``TrainingArguments`` sets up the devices.

    Raises:
        ValueError: naming ``use_cpu`` (and what to do instead) for a setting that cannot run several CPU processes.
    """
    global _CPU_WORLD_LOGGED
    # without use_cpu, accelerate on a CPU builds no process group: every process would train the whole job alone
    world = launched_world_size()
    if world <= 1 and not _CPU_WORLD_LOGGED and _accelerate_simple_launcher_asked_for_several():
        _CPU_WORLD_LOGGED = True
        from transformers.utils import logging

        logging.get_logger(__name__).warning(
            "accelerate launch started this one process although it was asked for several (it set MASTER_PORT and "
            "no WORLD_SIZE): on fewer than 2 GPUs and without --multi_gpu (or a MULTI_GPU config), accelerate's "
            "launcher runs one process (--cpu needs an MPI --mpirun_hostfile for more). Use `accelerate launch "
            "--multi_gpu --num_processes N train.py` or `torchrun --nproc_per_node N train.py` (docs/scaling.md)."
        )
    if world <= 1 or args.use_cpu or os.environ.get("ACCELERATE_USE_CPU", "").lower() in ("1", "true", "yes", "on"):
        return
    if _uses_configured_state(getattr(args, "accelerator_config", None)):
        return  # the script built the process group and accelerate's state itself (tests/distributed/run_es.py)
    if accelerator_process_group_backend() is not None:
        return  # GPUs (or another accelerator with a backend): accelerate sets up the process group
    deepspeed_launch = os.environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() == "true"  # accelerate's launcher
    if getattr(args, "deepspeed", None) or deepspeed_launch:
        raise ValueError(
            f"{world} processes were launched (WORLD_SIZE={world}) with DeepSpeed on a machine without GPU: accelerate "
            "picks no process-group backend for DeepSpeed on CPU, so every process would run the whole job alone. "
            "Either drop DeepSpeed and pass use_cpu=True (population parallelism over gloo), or build the process "
            "group first (deepspeed.init_distributed(dist_backend='gloo'), then "
            "accelerate.PartialState(backend='gloo') with ACCELERATE_USE_DEEPSPEED=true) and pass "
            "accelerator_config={'use_configured_state': True}, as tests/distributed/run_es.py does (docs/scaling.md)."
        )
    backend = getattr(args, "ddp_backend", None)
    if backend not in (None, "gloo", "mpi"):
        raise ValueError(
            f"{world} processes were launched (WORLD_SIZE={world}) on a machine without GPU, but ddp_backend="
            f"{backend!r} needs an accelerator: pass use_cpu=True with ddp_backend='gloo' (or unset) to run the "
            "processes on CPU, or launch on GPUs."
        )
    args.use_cpu = True
    if not _CPU_WORLD_LOGGED:
        _CPU_WORLD_LOGGED = True
        if os.environ.get("RANK", "0") == "0":
            from transformers.utils import logging

            logging.get_logger(__name__).warning(
                f"{world} processes were launched (WORLD_SIZE={world}) and no GPU is available: ESConfig runs them "
                "as use_cpu=True (one gloo process group, population parallelism; docs/scaling.md). Pass "
                "use_cpu=True to silence this."
            )


# ---------------------------------------------------------------------------------------------- ZeRO-3 partitions
def is_zero3_param(param: torch.Tensor) -> bool:
    """Whether ``param`` is a DeepSpeed ZeRO-3 partitioned parameter (it has ``ds_tensor`` and ``ds_numel``)."""
    return hasattr(param, "ds_id") and getattr(param, "ds_tensor", None) is not None


def zero3_partition(param: torch.Tensor, rank: int | None = None) -> tuple[torch.Tensor, int, int]:
    """``(local, numel, start)`` of a ZeRO-3 ``param``: a 1-D view of the real elements of ``param.ds_tensor``, the
    whole parameter's element count, and the flat index of ``local[0]``. ``rank`` in ``param.ds_process_group``
    defaults to ``torch.distributed``'s (0 if not initialized). Raises ``ValueError`` for another tensor."""
    if not is_zero3_param(param):
        raise ValueError("zero3_partition needs a DeepSpeed ZeRO-3 parameter (with ds_tensor and ds_numel).")
    if rank is None:
        rank = dist.get_rank(group=getattr(param, "ds_process_group", None)) if dist.is_initialized() else 0
    partition = param.ds_tensor.data.view(-1)  # rank r holds flat elements [r * P, (r + 1) * P)
    size = partition.numel()
    numel = int(param.ds_numel)
    start = min(rank * size, numel)
    real = max(0, min(size, numel - start))  # the last partitions are padded past ds_numel
    return partition.narrow(0, 0, real), numel, start


def es_parameter_entries(selected: Iterable[tuple[str, nn.Parameter]]) -> list[tuple]:
    """``(name, tensor)`` for whole parameters, ``(name, local, numel, start)`` for ZeRO-3 partitioned ones, for
    :class:`~trl_es.es.perturbation.TrainedParameters` (element ``j``'s noise depends only on ``(seed, name, j)``)."""
    entries = []
    for name, param in selected:
        if is_zero3_param(param):
            local, numel, start = zero3_partition(param)
            entries.append((name, local, numel, start))
        else:
            entries.append((name, param))
    return entries


def release_gathered_(params: Iterable[torch.Tensor]) -> int:
    """Drop ZeRO-3's gathered full copies of ``params`` (persistent or cached ones would show old values), so the
    next forward gathers the partitions ES wrote.

    Returns:
        `int`: How many parameters were released.
    """
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    released = [p for p in params if is_zero3_param(p) and p.ds_status == ZeroParamStatus.AVAILABLE]
    for param in released:
        param.partition()  # frees the full copy without writing it back: the partitions stay the truth
    return len(released)


def es_deepspeed_config(config: dict, micro_batch_size: int, world_size: int) -> dict:
    """Adapt a DeepSpeed config (in place) to ES, which has no backward pass and never steps a DeepSpeed optimizer
    (:data:`ES_DEEPSPEED_NOTE`).

    ``micro_batch_size`` is ``per_device_train_batch_size``; returns ``config``.
    """
    # no optimizer: no fp32 copy, state or gradient buffer (ZeRO-3: DeepSpeedZeRoOffload, the ZeRO-Inference path)
    config.pop("optimizer", None)
    config.pop("scheduler", None)
    zero = config.setdefault("zero_optimization", {})
    stage = int(zero.get("stage", 0) or 0)
    if stage in (1, 2):  # they shard optimizer states and gradients only, which ES has not: population parallelism
        zero["stage"] = 0
        for key in ("bf16", "fp16"):  # without ZeRO, DeepSpeed's BF16/FP16 optimizer would allocate fp32 copies
            if key in config:
                config[key]["enabled"] = False
    if stage == 3 and zero.get("stage3_gather_16bit_weights_on_model_save") in (None, "auto"):
        zero["stage3_gather_16bit_weights_on_model_save"] = True  # checkpoints load with from_pretrained
    # ES's batch: the prompts a process loads per iteration (DeepSpeed only checks them)
    config["train_micro_batch_size_per_gpu"] = int(micro_batch_size)
    config["gradient_accumulation_steps"] = 1
    config["train_batch_size"] = int(micro_batch_size) * int(world_size)
    config.pop("gradient_clipping", None)
    return config


# ---------------------------------------------------------------------------------------------- replicas agree
def fingerprints_agree(digest: bytes, device=None) -> tuple[bool, int]:
    """All-gather every process's 16-byte ``digest`` and tell whether they are all equal.

    Returns:
        `(agree, bytes)`: ``bytes`` is the size of the gathered buffer on this process.
    """
    world = dist.get_world_size()
    local = torch.tensor(list(digest), dtype=torch.uint8, device=device)  # on the backend's device (nccl: GPU)
    gathered = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(gathered, local)
    return all(torch.equal(g, gathered[0]) for g in gathered), world * local.numel()


def broadcast_tensors_(tensors: Sequence[torch.Tensor], src: int = 0) -> int:
    """``torch.distributed.broadcast`` each tensor from ``src`` in place. Returns the bytes broadcast."""
    total = 0
    for tensor in tensors:
        dist.broadcast(tensor.data, src=src)
        total += tensor.numel() * tensor.element_size()
    return total


# ---------------------------------------------------------------------------------------------- counted collectives
def all_gather_objects(obj) -> tuple[list, int]:
    """``torch.distributed.all_gather_object``, also returning the bytes it moves into this process.

    Returns:
        `(objects, bytes)`: one object per process, in rank order, and the bytes counted.
    """
    world = dist.get_world_size()
    objects = [None] * world
    dist.all_gather_object(objects, obj)
    largest = max(len(pickle.dumps(o)) for o in objects)
    # the sizes (one int64 per process), then every pickle padded to the largest
    return objects, 8 * world + world * largest


def tensor_bytes(tensor: torch.Tensor) -> int:
    """Bytes of a tensor's elements (the buffer a collective on it moves into each process)."""
    return tensor.numel() * tensor.element_size()


# ---------------------------------------------------------------------------------------------- checkpoints, any W
SHARD_PATTERN = re.compile(r"^(?P<base>.+)\.rank(?P<rank>\d+)-of-(?P<world>\d+)\.safetensors$")


def read_flat_ranges(folder: str, base: str, layout: dict[str, tuple[int, int]]) -> dict[str, torch.Tensor] | None:
    """Elements ``[start, start + length)`` of the flattened tensors of a checkpoint's ``base`` file (or of its
    ZeRO-3 shards ``{stem}.rank{r}-of-{W}.safetensors``), whatever number of processes wrote it.
    ``layout`` maps ``name -> (start, length)``; returns flat tensors in the file's dtype, or ``None`` if neither
    the file nor shards exist.

    Raises:
        ValueError: if the shards are incomplete (another world size mixed in, a missing rank, or elements of a
            wanted range that no shard holds), or a name is missing.
    """
    from safetensors import safe_open

    whole = os.path.join(folder, base)
    stem = base[: -len(".safetensors")]
    if os.path.isfile(whole):  # written by one process: slice each tensor
        out = {}
        with safe_open(whole, framework="pt") as f:
            keys = set(f.keys())
            for name, (start, length) in layout.items():
                if name not in keys:
                    raise ValueError(f"{whole} has no tensor {name!r}.")
                out[name] = f.get_tensor(name).reshape(-1)[start : start + length].clone()
        return out
    shards = sorted(n for n in os.listdir(folder) if (m := SHARD_PATTERN.match(n)) and m["base"] == stem)
    if not shards:
        return None
    worlds = {int(SHARD_PATTERN.match(n)["world"]) for n in shards}
    ranks = {int(SHARD_PATTERN.match(n)["rank"]) for n in shards}
    if len(worlds) != 1 or ranks != set(range(next(iter(worlds)))):  # one launch, every rank
        raise ValueError(f"{folder!r}: the {stem} shards are incomplete or from several launches: {shards}.")
    out, filled = {}, dict.fromkeys(layout, 0)  # elements read per name, to catch a range no shard holds
    for shard in shards:
        with safe_open(os.path.join(folder, shard), framework="pt") as f:
            metadata = f.metadata() or {}
            for name, (start, length) in layout.items():
                if name not in metadata:
                    continue
                s_start, s_length, _ = map(int, metadata[name].split(","))  # start,length,numel of this shard's piece
                lo, hi = max(start, s_start), min(start + length, s_start + s_length)  # read the overlap only
                if lo >= hi:
                    continue
                piece = f.get_tensor(name).reshape(-1)[lo - s_start : hi - s_start]
                if name not in out:
                    out[name] = torch.empty(length, dtype=piece.dtype)
                out[name][lo - start : hi - start] = piece
                filled[name] += hi - lo
    missing = [n for n, (_, length) in layout.items() if filled[n] != length]
    if missing:
        raise ValueError(f"{folder!r}: the {stem} shards do not hold all of {missing[:3]}.")
    return out


# ------------------------------------------------------------------------- a streaming dataset every process reads
class SharedStream(torch.utils.data.IterableDataset):
    """A streaming dataset that every process reads whole, in the same order (the passes chained into one stream).

    Args:
        dataset (`Iterable[dict]`): The stream of rows.
    """
    # accelerate splits a datasets.IterableDataset with >= num_processes shards *by shard* (each process would read
    # other files); behind a plain torch iterable it slices every batch instead (IterableDatasetShard).

    def __init__(self, dataset):
        self.dataset = dataset
        self.epoch = 0  # set by Trainer, 0 at the start

    def __iter__(self):
        # One endless sequence over the passes (a batch may span two), so Trainer sees one epoch ending at max_steps
        # and a resume skips exactly the batches of the uninterrupted run, in every pass.
        for passes in itertools.count():
            if hasattr(self.dataset, "set_epoch"):
                self.dataset.set_epoch(self.epoch + passes)  # datasets reshuffles a shuffled stream per epoch
            empty = True
            for row in self.dataset:
                empty = False
                yield row
            if empty:  # a pass with no row ends the stream
                return

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
