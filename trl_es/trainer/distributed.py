"""Multi-process ES: population parallelism and DeepSpeed ZeRO-3 sharded ES.

Two ways to spread an ES iteration over ``W`` processes (see ``docs/scaling.md``):

- **Population parallelism** (plain ``torchrun`` / ``accelerate launch``, or DeepSpeed ZeRO-1/2): every process holds
  the whole model, scores the members ``i % W == rank`` on the same prompt batch, and the fitness values are summed
  across processes. Every process then applies the same update from the member seeds: no weights and no gradients
  travel. The model is *not* wrapped in ``DistributedDataParallel`` (its gradient buckets would cost one more copy
  of the weights and are never used: ES has no backward pass).
- **Sharded ES** (DeepSpeed ZeRO-3): the parameters are partitioned across processes. Members are scored one at a
  time by all processes together, each generating for its own share of the prompts (ZeRO-3 gathers the partitions
  on the fly); each process perturbs, restores and updates only its own partition.

This module holds the pieces that do not need the trainer: partition bookkeeping, the DeepSpeed config for ES,
fingerprints that check the replicas agree, and byte-counted collectives.
"""

from __future__ import annotations

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
    ``None`` when there is none (a CPU, or an accelerator without one, such as MPS): accelerate then sets up no
    process group at all unless ``use_cpu=True``."""
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
    """Whether this process was started by accelerate's one-process ("simple") launcher that was asked for several
    processes: it sets ``ACCELERATE_USE_CPU`` and ``ACCELERATE_MIXED_PRECISION`` always, and ``MASTER_PORT`` only for
    ``--num_processes > 1`` (or several machines), but starts one process without ``WORLD_SIZE`` (accelerate 1.16,
    ``prepare_simple_launcher_cmd_env``)."""
    env = os.environ
    return (all(name in env for name in ("ACCELERATE_USE_CPU", "ACCELERATE_MIXED_PRECISION", "MASTER_PORT"))
            and not any(name in env for name in (*WORLD_SIZE_VARIABLES, "LOCAL_RANK", "RANK")))


def resolve_cpu_world(args) -> None:
    """Make a job launched with several processes on a machine without GPU run as those processes.

    ``torchrun --nproc_per_node N`` (or ``accelerate launch --multi_gpu``, ``deepspeed``) sets ``WORLD_SIZE=N``, but
    on a CPU accelerate only builds a process group with ``use_cpu=True`` (``ACCELERATE_USE_CPU=1``): otherwise every
    process sees ``world_size 1``, trains the whole population alone and writes the same files as the others. Called
    by ``ESConfig.__post_init__`` before ``TrainingArguments`` sets up the devices:

    - with several launched processes, no accelerator with a process-group backend, no ``use_cpu`` and no
      pre-built state (``accelerator_config={"use_configured_state": True}``), set ``args.use_cpu = True``: the
      processes join one gloo process group (population parallelism), logged once;
    - DeepSpeed there (``deepspeed=...`` or accelerate's DeepSpeed launcher), or a GPU-only ``ddp_backend``, cannot
      run so: raise before any work;
    - one process started by ``accelerate launch --num_processes N`` without ``--multi_gpu`` (accelerate's one-process
      launcher, which a CPU gets): warn once, naming the launch lines that start N processes.

    Raises:
        ValueError: naming ``use_cpu`` (and what to do instead) for a setting that cannot run several CPU processes.
    """
    global _CPU_WORLD_LOGGED
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
    """The locally held elements of a ZeRO-3 parameter.

    DeepSpeed stores rank ``r``'s share of the flattened parameter in ``param.ds_tensor`` (1-D, ``P`` elements, the
    same ``P`` on every rank): elements ``[r * P, (r + 1) * P)``. The last partitions are padded past
    ``param.ds_numel``; only the first ``min(P, ds_numel - r * P)`` elements (possibly none) are real.

    Args:
        param (`torch.Tensor`): A ZeRO-3 parameter.
        rank (`int`, *optional*): This process's rank in the parameter's partition group (``param.ds_process_group``);
            default: asked from ``torch.distributed`` (0 if it is not initialized).

    Returns:
        `(local, numel, start)`: ``local`` is a contiguous 1-D view of the real elements of ``param.ds_tensor``
        (same dtype and device), ``numel`` the number of elements of the whole parameter and ``start`` the flat index
        of ``local[0]`` in it.

    Raises:
        ValueError: if ``param`` is not a ZeRO-3 parameter.
    """
    if not is_zero3_param(param):
        raise ValueError("zero3_partition needs a DeepSpeed ZeRO-3 parameter (with ds_tensor and ds_numel).")
    if rank is None:
        rank = dist.get_rank(group=getattr(param, "ds_process_group", None)) if dist.is_initialized() else 0
    partition = param.ds_tensor.data.view(-1)
    size = partition.numel()
    numel = int(param.ds_numel)
    start = min(rank * size, numel)
    real = max(0, min(size, numel - start))
    return partition.narrow(0, 0, real), numel, start


def es_parameter_entries(selected: Iterable[tuple[str, nn.Parameter]]) -> list[tuple]:
    """``(name, tensor)`` for whole parameters, ``(name, local, numel, start)`` for ZeRO-3 partitioned ones.

    The result feeds :class:`~trl_es.es.update.TrainedParameters`, which then perturbs and updates only the local
    elements; the noise of element ``j`` depends only on ``(seed, name, j)``, so a partitioned run moves every
    element exactly as a single-process run does.
    """
    entries = []
    for name, param in selected:
        if is_zero3_param(param):
            local, numel, start = zero3_partition(param)
            entries.append((name, local, numel, start))
        else:
            entries.append((name, param))
    return entries


def release_gathered_(params: Iterable[torch.Tensor]) -> int:
    """Drop ZeRO-3's gathered full copies of ``params``, so the next forward gathers the current partitions.

    ES writes the partitions (``ds_tensor``) in place. A parameter ZeRO-3 keeps gathered between forwards (the
    persistent parameters below ``stage3_param_persistence_threshold``, and any still cached from the last forward)
    would otherwise be seen with its old values. ``param.partition()`` frees the full copy without writing it back
    (``has_been_updated=False``), so the partitions stay the truth.

    Returns:
        `int`: How many parameters were released.
    """
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    released = [p for p in params if is_zero3_param(p) and p.ds_status == ZeroParamStatus.AVAILABLE]
    for param in released:
        param.partition()
    return len(released)


def es_deepspeed_config(config: dict, micro_batch_size: int, world_size: int) -> dict:
    """Adapt a DeepSpeed config (in place) to ES, which has no backward pass and never steps a DeepSpeed optimizer.

    - ``optimizer`` and ``scheduler`` are removed: ``deepspeed.initialize`` then builds no optimizer, so no fp32
      copy, optimizer state or gradient buffer is allocated (ZeRO-3: DeepSpeed's ``DeepSpeedZeRoOffload``, its
      ZeRO-Inference path; the same path ``transformers``' ``deepspeed_init(..., inference=True)`` takes).
    - ZeRO stages 1 and 2 shard optimizer states and gradients only, so for ES they are stage 0 (and DeepSpeed
      refuses them without an optimizer). Every process then holds the whole model: population parallelism. The
      bf16/fp16 sections are disabled there too: without ZeRO DeepSpeed would wrap the model in its BF16/FP16
      optimizer, which allocates fp32 copies and gradient buffers. The model keeps the dtype it was loaded in.
    - ZeRO-3 keeps everything else (parameter partitioning, offload, bf16).
      ``stage3_gather_16bit_weights_on_model_save`` defaults to ``True`` so checkpoints are loadable with
      ``from_pretrained``.
    - The batch sizes are set to ES's (the prompts a process loads per iteration); DeepSpeed only checks them.

    Args:
        config (`dict`): The DeepSpeed config (``accelerator.state.deepspeed_plugin.deepspeed_config``).
        micro_batch_size (`int`): Prompts per process per iteration (``per_device_train_batch_size``).
        world_size (`int`): Number of processes.

    Returns:
        `dict`: ``config``, modified.
    """
    config.pop("optimizer", None)
    config.pop("scheduler", None)
    zero = config.setdefault("zero_optimization", {})
    stage = int(zero.get("stage", 0) or 0)
    if stage in (1, 2):
        zero["stage"] = 0
        for key in ("bf16", "fp16"):
            if key in config:
                config[key]["enabled"] = False
    if stage == 3 and zero.get("stage3_gather_16bit_weights_on_model_save") in (None, "auto"):
        zero["stage3_gather_16bit_weights_on_model_save"] = True
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
    local = torch.tensor(list(digest), dtype=torch.uint8, device=device)
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

    ``all_gather_object`` pickles the object, all-gathers the sizes (one int64 per process), pads every pickle to
    the largest and all-gathers the padded byte tensors. The count is the size of both gathered buffers:
    ``8 * W + W * max_pickle_size``.

    Returns:
        `(objects, bytes)`: one object per process, in rank order, and the bytes counted.
    """
    world = dist.get_world_size()
    objects = [None] * world
    dist.all_gather_object(objects, obj)
    largest = max(len(pickle.dumps(o)) for o in objects)
    return objects, 8 * world + world * largest


def tensor_bytes(tensor: torch.Tensor) -> int:
    """Bytes of a tensor's elements (the buffer a collective on it moves into each process)."""
    return tensor.numel() * tensor.element_size()


# ---------------------------------------------------------------------------------------------- checkpoints, any W
SHARD_PATTERN = re.compile(r"^(?P<base>.+)\.rank(?P<rank>\d+)-of-(?P<world>\d+)\.safetensors$")


def read_flat_ranges(folder: str, base: str, layout: dict[str, tuple[int, int]]) -> dict[str, torch.Tensor] | None:
    """Elements ``[start, start + length)`` of the flattened tensors of a checkpoint's ``base`` file, whatever number
    of processes wrote it.

    ``base`` (e.g. ``"es_master.safetensors"``) is either one whole file, or the per-process shards
    ``es_master.rank{r}-of-{W}.safetensors`` that ZeRO-3 runs write (each tensor's ``start,length,numel`` in the file
    metadata). Only the overlapping pieces are read, so a process of any partitioning (one process, another ``W``)
    gets exactly its elements.

    Args:
        folder (`str`): The checkpoint folder.
        base (`str`): The whole file's name.
        layout (`dict[str, tuple[int, int]]`): ``name -> (start, length)`` wanted.

    Returns:
        `dict[str, torch.Tensor] | None`: Flat tensors (the file's dtype), or ``None`` if neither the file nor shards
        exist.

    Raises:
        ValueError: if the shards are incomplete (another world size mixed in, a missing rank, or elements of a
            wanted range that no shard holds), or a name is missing.
    """
    from safetensors import safe_open

    whole = os.path.join(folder, base)
    stem = base[: -len(".safetensors")]
    if os.path.isfile(whole):
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
    if len(worlds) != 1 or ranks != set(range(next(iter(worlds)))):
        raise ValueError(f"{folder!r}: the {stem} shards are incomplete or from several launches: {shards}.")
    out, filled = {}, dict.fromkeys(layout, 0)
    for shard in shards:
        with safe_open(os.path.join(folder, shard), framework="pt") as f:
            metadata = f.metadata() or {}
            for name, (start, length) in layout.items():
                if name not in metadata:
                    continue
                s_start, s_length, _ = map(int, metadata[name].split(","))
                lo, hi = max(start, s_start), min(start + length, s_start + s_length)
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
