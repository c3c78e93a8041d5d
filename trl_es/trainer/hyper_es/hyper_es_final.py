"""The genome a Hyper-ES run keeps (``HyperESConfig.final_genome``): the answer of the search, chosen after it ends.

``"best"``: the best candidate scored; ``"mean"``: the CMA-ES mean (pycma's ``result.xfavorite``, Hansen 2016, "The
CMA Evolution Strategy: A Tutorial"); ``"rescored"`` / ``"validation"``: the :func:`finalists` re-scored on the whole
fitness split / on ``eval_dataset``, the highest kept.
"""

from __future__ import annotations

import logging
import math

from ...es.cma_search import CMASearch
from ...merging.genome import Genome, GenomeSpace


__all__ = ["choose_final_genome", "finalists"]

logger = logging.getLogger(__name__)


def finalists(trainer, search: CMASearch) -> tuple[list[Genome], list[dict]]:
    """The genomes ``"rescored"`` and ``"validation"`` choose among: the best candidates seen
    (:attr:`CMASearch.top`, highest search fitness first), the final CMA-ES mean, and the uniform merge, last.

    Returns:
        `(list[Genome], list[dict])`: The genomes and one ``{"candidate", "generation", "index", "search_fitness"}``
        record per genome (``"top1"``, ..., ``"mean"`` and ``"start"``, whose search fitness is `None`).
    """
    top = getattr(search, "top", [])
    genomes = [trainer.candidate_genome(x, *tag) for _, x, tag in top] + [trainer.space.decode(search.mean)]
    record = [
        {"candidate": f"top{rank + 1}", "generation": int(tag[0]), "index": int(tag[1]), "search_fitness": float(f)}
        for rank, (f, _, tag) in enumerate(top)
    ]
    record.append({"candidate": "mean", "generation": search.generation, "index": None, "search_fitness": None})
    # the search's start: a search that finds nothing better on the choosing rows returns it, not a lucky candidate
    genomes.append(trainer.space.uniform(trainer.args.initial_weight))
    record.append({"candidate": "start", "generation": 0, "index": None, "search_fitness": None})
    return genomes, record


def choose_final_genome(trainer, search: CMASearch) -> tuple[Genome, float, list[dict]]:
    """The genome kept after training (``trainer.args.final_genome``), the score it was chosen by, and the
    :func:`finalists` record with each genome's ``"fitness"`` or ``"validation"`` score (empty for ``"best"`` and
    ``"mean"``).

    Raises:
        ValueError: If candidates were scored but none got a finite fitness (every reward ``None``), or no
            re-scored genome did, or ``"validation"`` without an ``eval_dataset``.
    """
    mode = trainer.args.final_genome
    num_told, num_finite = getattr(search, "num_told", 0), getattr(search, "num_finite", 0)
    if num_told and not num_finite:
        raise ValueError(
            f"Hyper-ES: none of the {num_told} candidates scored in {search.generation} generation(s) got a "
            "finite fitness (every reward function returned None / NaN for every completion), so there is no "
            f"basis for final_genome={mode!r}. Check that the reward functions apply to this dataset (the "
            "columns they read) and to these completions."
        )
    # "best" keeps the top score among many noisy ones: a winner's curse (the candidate whose prompts suited it)
    if mode == "best" and search.best_x is not None:
        return trainer.candidate_genome(search.best_x, *search.best_tag), float(search.best_fitness), []
    # "mean" (or nothing to re-score): a weighted average of the selected candidates averages their luck out; its
    # score is the best fitness seen
    if mode not in ("rescored", "validation") or not getattr(search, "top", []):
        return trainer.space.decode(search.mean), float(search.best_fitness), []
    if mode == "validation":  # chosen on rows the candidates were not selected with
        dataset, key, where = trainer.eval_dataset, "validation", "the validation rows (eval_dataset)"
        if dataset is None:
            raise ValueError("final_genome='validation' needs an eval_dataset (the validation rows).")
    else:
        dataset, key, where = trainer.train_dataset, "fitness", "the whole fitness split"
    rows = [dataset[i] for i in range(len(dataset))] if dataset is not None else []
    genomes, record = finalists(trainer, search)
    scores = trainer.score_genomes(genomes, rows)
    for item, score in zip(record, scores, strict=True):
        item[key] = float(score)
    finite = [i for i, s in enumerate(scores) if math.isfinite(s)]
    if not finite:
        raise ValueError(
            f"Hyper-ES: none of the {len(genomes)} genomes re-scored on {where} got a finite score (every reward "
            "was None / NaN); no final genome can be chosen."
        )
    # the highest; among equals the start (nothing beat it), then the first in the order of `genomes`
    best = max(finite, key=lambda i: (scores[i], record[i]["candidate"] == "start", -i))
    logger.info(f"Re-scored {len(genomes)} genomes on {where}: {record}; kept {record[best]}.")
    return genomes[best], float(scores[best]), record


def resolve_genome(genome, space: GenomeSpace, initial_weight: float, best_genome: Genome | None):
    """What :meth:`HyperESTrainer.evaluate` and ``merged`` apply for their ``genome`` argument (`None`, ``"base"``,
    ``"uniform"``, ``"best"``, an adapter index or a [`Genome`]): `None`, ``"base"``, an adapter index or a
    [`Genome`], as ``MergeApplier.applied`` takes. Raises ``ValueError`` for an unknown ``genome``, or ``"best"``
    before training (``best_genome`` `None`)."""
    if genome is None:  # the model as it is
        return None
    # a bool is an int to Python, but True is no adapter index
    if isinstance(genome, Genome) or isinstance(genome, int) and not isinstance(genome, bool):
        return genome
    if genome == "base":
        return "base"
    if genome == "uniform":  # the search's start: every coefficient initial_weight
        return space.uniform(initial_weight)
    if genome == "best":
        if best_genome is None:
            raise ValueError("genome='best' needs a trained genome: call train() first.")
        return best_genome
    raise ValueError(f"genome must be a Genome, an adapter index, 'base', 'uniform' or 'best'; got {genome!r}.")
