"""Hyper-ES checkpoint files: what ``checkpoint-<generation>/`` holds, written and read back.

A checkpoint folder holds ``hyper_es_state.pkl`` (the pickled :class:`~trl_es.es.cma_search.CMASearch`, its
history, the fitness-row position and the genome space's shape), ``best_genome.json`` (when there is a best) and
``trainer_state.json``; no model weights. Checkpoints are pickles: only load your own.
"""

from __future__ import annotations

import os
import pickle

from transformers.trainer_callback import TrainerState
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, rotate_checkpoints
from transformers.utils import logging

from ...es.cma_search import CMASearch
from ...files import atomic_path
from ...merging.genome import Genome, GenomeSpace


__all__ = ["GENOME_NAME", "STATE_NAME", "TRAINER_STATE_NAME", "HyperESCheckpointMixin", "load_search_checkpoint",
           "save_search_checkpoint"]

logger = logging.get_logger(__name__)

STATE_NAME = "hyper_es_state.pkl"
GENOME_NAME = "best_genome.json"
TRAINER_STATE_NAME = "trainer_state.json"


def save_search_checkpoint(
    folder: str,
    search: CMASearch,
    history: list[dict],
    space: GenomeSpace,
    trainer_state: TrainerState,
    best_genome: Genome | None = None,
    rows_drawn: int | None = None,
) -> None:
    """Write a checkpoint of the search into ``folder`` (the ``checkpoint-<generation>`` folder, created if needed):
    ``search``, its per-generation ``history``, ``rows_drawn`` (fitness rows used so far), ``space``'s shape,
    ``trainer_state`` and ``best_genome``."""
    os.makedirs(folder, exist_ok=True)
    payload = {
        "version": 2,  # 2 records rows_drawn
        "search": search,  # pickled with its sampler's RNG: resuming continues it bit for bit
        "history": history,
        "rows_drawn": rows_drawn,
        # the space's size and adapter names: load_search_checkpoint refuses a resume into another space
        "space_dim": space.dim,
        "group_names": space.group_names,
        "adapter_names": space.adapter_names,
    }
    if best_genome is not None:
        best_genome.save_json(os.path.join(folder, GENOME_NAME))
    # every file atomic; no model weights: the merge is rebuilt from a genome and the adapters
    with atomic_path(os.path.join(folder, TRAINER_STATE_NAME)) as tmp:
        trainer_state.save_to_json(tmp)
    # The CMA-ES state last: a checkpoint folder that holds it is complete (resuming needs it).
    with atomic_path(os.path.join(folder, STATE_NAME)) as tmp, open(tmp, "wb") as f:
        pickle.dump(payload, f)


def load_search_checkpoint(
    folder: str, space: GenomeSpace
) -> tuple[CMASearch, list[dict], TrainerState | None, int | None]:
    """Read back what :func:`save_search_checkpoint` wrote: ``(search, history, trainer_state, rows_drawn)``, the
    last two `None` when not recorded. Raises ``ValueError`` if the checkpoint was made for another genome space."""
    with open(os.path.join(folder, STATE_NAME), "rb") as f:
        payload = _MovedModulesUnpickler(f).load()  # our own checkpoint format (pycma's state pickles)
    if payload["space_dim"] != space.dim or payload["adapter_names"] != space.adapter_names:
        raise ValueError(
            f"Checkpoint {folder!r} was made for {payload['space_dim']} coefficients over adapters "
            f"{payload['adapter_names']}; this trainer has {space.dim} over {space.adapter_names}."
        )
    state_file = os.path.join(folder, TRAINER_STATE_NAME)
    trainer_state = TrainerState.load_from_json(state_file) if os.path.exists(state_file) else None
    # a version-1 checkpoint has no rows_drawn: None, and the caller derives it from the generation
    return payload["search"], payload["history"], trainer_state, payload.get("rows_drawn")


#: (module, name) that checkpoints pickled before a class moved -> where it is now
MOVED = {("trl_es.trainer.hyper_es_trainer", "CMASearch"): ("trl_es.es.cma_search", "CMASearch")}


class _MovedModulesUnpickler(pickle.Unpickler):
    """Reads checkpoints written before a pickled class moved (:data:`MOVED`)."""

    def find_class(self, module: str, name: str):
        return super().find_class(*MOVED.get((module, name), (module, name)))


class HyperESCheckpointMixin:
    """Checkpoint save and load of :class:`~trl_es.trainer.hyper_es.hyper_es_trainer.HyperESTrainer` (it reads
    ``args``, ``search``, ``history``, ``space``, ``state``, ``rows_drawn`` and ``candidate_genome``)."""

    def _save_checkpoint_state(self) -> str:
        search = self.search
        folder = os.path.join(self.args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{search.generation}")
        if self.args.should_save:  # one process writes; every process returns the folder
            best = self.candidate_genome(search.best_x, *search.best_tag) if search.best_x is not None else None
            save_search_checkpoint(
                folder, search, self.history, self.space, self.state, best_genome=best, rows_drawn=self.rows_drawn
            )
            # transformers' own rotation: keeps the save_total_limit newest checkpoint-<n> folders
            rotate_checkpoints(self.args.output_dir, save_total_limit=self.args.save_total_limit)
        return folder

    def _load_checkpoint(self, folder: str) -> None:
        self.search, self.history, state, rows_drawn = load_search_checkpoint(folder, self.space)
        per_generation = self.args.prompt_batch_size or 0  # checkpoints from before the row cursor: one batch each
        self.rows_drawn = rows_drawn if rows_drawn is not None else self.search.generation * per_generation
        if state is not None:
            self.state = state
        self.state.global_step = self.search.generation  # a step is a generation
        logger.info(f"Resumed Hyper-ES from {folder} at generation {self.search.generation}.")
