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
    - ZeRO-3 keeps everything else (parameter partitioning, offload, bf16). ``stage3_gather_16bit_weights_on_model_save``
      defaults to ``True`` so checkpoints are loadable with ``from_pretrained``.
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
    out, filled = {}, {name: 0 for name in layout}
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
