"""How ESTrainer reads its prompt rows: map-style datasets as ``Trainer`` does, streams read whole by every process
(:class:`SharedStream`), and the gather that gives every process the whole prompt batch.

A mixin of :class:`~trl_es.trainer.es.es_trainer.ESTrainer` (it reads ``args``, ``accelerator``, ``sharded`` and
``_comm_bytes``).
"""

from __future__ import annotations

import itertools

import torch
from transformers.utils import logging

from ..distributed import all_gather_objects
from .es_config import ESConfig

logger = logging.get_logger(__name__)


def identity(features):
    """Data collator that keeps the rows as they are (a list of dicts)."""
    return features


class SharedStream(torch.utils.data.IterableDataset):
    """An iterable (streaming) dataset that every process reads whole, in the same order.

    ``accelerate`` splits a ``datasets.IterableDataset`` with at least as many shards (data files) as processes *by
    shard*: each process would read other files, so the gathered prompt batch would differ from one process's and
    shards of unequal length would end the epoch on different processes. Behind this plain ``torch`` iterable,
    ``accelerate`` keeps each process's slice of every batch instead (``IterableDatasetShard``), as for a single-shard
    stream.

    The passes over the stream are chained into one endless sequence of rows (a batch may span the end of one pass
    and the start of the next), pass ``p`` read after ``dataset.set_epoch(epoch + p)`` (``datasets`` reshuffles a
    shuffled stream with it; ``epoch`` is what ``Trainer`` set, 0 at the start). ``Trainer`` sees one epoch that
    ends at ``max_steps``, so the batches it reads past when resuming are exactly those of the uninterrupted run, in
    every pass (with an epoch per pass, it would skip only within the first pass and restart a later one from its
    beginning). A pass that yields no row ends the sequence.

    Args:
        dataset (`Iterable[dict]`): The stream of rows.
    """

    def __init__(self, dataset):
        self.dataset = dataset
        self.epoch = 0

    def __iter__(self):
        for passes in itertools.count():
            if hasattr(self.dataset, "set_epoch"):
                self.dataset.set_epoch(self.epoch + passes)
            empty = True
            for row in self.dataset:
                empty = False
                yield row
            if empty:
                return

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch


class ESDataMixin:
    """Prompt data of :class:`~trl_es.trainer.es.es_trainer.ESTrainer`: streams, the kept columns, the gathers."""

    @staticmethod
    def _check_iterable_train_dataset(args: ESConfig) -> None:
        """An iterable (streaming) train dataset, as TRL's trainers take it: ``max_steps`` must say how long to train,
        and every process reads the stream itself.

        ``accelerate`` would otherwise *dispatch* an iterable dataset's batches: process 0 reads them and broadcasts
        them as tensors, which text rows are not. With ``dispatch_batches=False`` every process iterates the same
        stream and keeps its slice of each ``prompt_batch_size`` batch (``IterableDatasetShard``); the slices are then
        gathered as for a map-style dataset, so every process scores the same prompt rows in the same order. On resume,
        ``Trainer`` skips the batches already used by reading past them (unless ``ignore_data_skip``).

        ``dataloader_num_workers`` is set to 0 (with a warning), as GRPOTrainer does: workers would read the stream's
        shards in turn and interleave them.

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
        if args.dataloader_num_workers != 0:  # as GRPOTrainer: workers would interleave the stream's shards
            logger.warning(f"An iterable train dataset is read in stream order with dataloader_num_workers=0 "
                           f"(several workers would interleave its shards); overriding {args.dataloader_num_workers}.")
            args.dataloader_num_workers = 0

    def _set_signature_columns_if_needed(self):
        # Rows go to the reward functions as they are: keep every column.
        if self._signature_columns is None:
            self._signature_columns = ["prompt"]

    def _gather_prompt_rows(self, rows: list[dict]) -> list[dict]:
        """Each process loaded its share of the prompt batch; with population parallelism every process needs all of
        it (``torch.distributed.all_gather_object``, counted in ``comm/bytes``). Sharded (ZeRO-3) processes keep their
        share: each generates for its own prompts."""
        return list(rows) if self.sharded else self._gather_objects(rows)

    def _gather_objects(self, objects: list) -> list:
        """Every process's ``objects``, concatenated in rank order (``torch.distributed.all_gather_object``, the
        bytes it moves counted in ``comm/bytes``); on one process, ``objects`` itself."""
        if self.accelerator.num_processes == 1:
            return list(objects)
        parts, nbytes = all_gather_objects(list(objects))
        self._comm_bytes += nbytes
        return [obj for part in parts for obj in part]
