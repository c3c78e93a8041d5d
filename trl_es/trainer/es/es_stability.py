"""ESTrainer's run stability: ``sigma="auto"`` (:mod:`trl_es.es.autosigma`) and the collapse guard
(:mod:`trl_es.es.guard`), both kept in the seed log so that replay, resume, W processes and the vLLM engines agree
bitwise.

- ``sigma="auto"``: before the first iteration, probes on the first batch and prompts drawn from the training set up
  to ``sigma_calibration_prompts`` (greedy rollouts of the center and of the first
  :data:`~trl_es.es.autosigma.PROBE_MEMBERS` members) pick the sigma whose effect is ``sigma_target``, and
  again (from the sigma in use; that iteration's batch and its own draws) after a rollback and every
  ``sigma_adapt_steps`` iterations; every
  record holds the sigma its members were scored at (``sigma``), a calibrating record also the probes
  (``sigma_probes``) and the effect measured at the chosen sigma (``sigma_effect``). A resumed run reads sigma from
  the log.
- ``collapse_guard=True``: every record holds the iteration's ``fitness_mean`` and ``fitness_se``; a collapse makes the
  iteration's record a rollback (``rollback_to``, ``undone``). The guard's state is rebuilt from the records.
"""

from __future__ import annotations

import copy
import dataclasses

import numpy as np
import torch
from transformers.utils import logging

from ...es.autosigma import (
    PROBE_MEMBERS,
    SIGMA_AUTO,
    START_SIGMA,
    SigmaSearch,
    differing_completions,
    differing_rewards,
)
from ...es.fitness import PopulationScores, shape_fitness
from ...es.guard import CollapseGuard, mean_and_se
from ...es.perturbation import Member, es_update_
from ...es.strategy import TellResult, member_indices
from ...rollout import Rollout, RolloutResult


logger = logging.get_logger(__name__)

#: Config fields of the guard and of sigma="auto" kept in the seed-log header's run_settings (compared on resume).
GUARD_SETTINGS = ("collapse_guard", "collapse_guard_threshold", "collapse_guard_patience",
                  "collapse_guard_alpha_factor")


class ESStability:
    """``sigma="auto"`` and the collapse guard of one :class:`~trl_es.ESTrainer` (see the module docstring); the
    trainer calls it only where one of them is on."""

    def __init__(self, trainer):
        self.trainer = trainer
        self.draws = self._calibration_draws()  # prompts a calibration draws besides its batch (all processes)

    def _calibration_draws(self) -> int:
        """``sigma_calibration_prompts - prompt_batch_size`` (at least 0), and with one warning fewer: at most
        ``train_dataset``'s rows (none from an iterable dataset), under ZeRO-3 a multiple of the process count (each
        process rolls out an equal share). Placeholder rows of an environment that owns the data are not capped."""
        args, trainer = self.trainer.args, self.trainer
        asked = max(0, args.sigma_calibration_prompts - args.prompt_batch_size) if args.sigma == SIGMA_AUTO else 0
        processes = trainer.accelerator.num_processes if trainer.sharded else 1
        dataset = trainer.train_dataset
        if dataset is None:  # nothing to train on (evaluate only): no calibration runs
            return 0
        available = asked if trainer.agents.owns_data else len(dataset) if hasattr(dataset, "__len__") else 0
        capped = min(asked, available)
        draws = capped - capped % processes
        why = ["it is iterable (no length)" if not hasattr(dataset, "__len__") else f"it has {available} rows"
               ] if capped < asked else []
        if draws < capped:
            why.append(f"its {processes} ZeRO-3 processes roll out equal shares")
        if why:
            logger.warning(f"sigma_calibration_prompts={args.sigma_calibration_prompts} asks sigma='auto' to calibrate "
                           f"on {asked} prompts of train_dataset besides the iteration's batch, but {' and '.join(why)}"
                           f": it calibrates on {draws} drawn prompts.")
        return draws

    def add_settings(self, header: dict) -> None:
        """Add ``sigma_target``, ``sigma_adapt_steps`` and ``sigma_calibration_prompts`` (with ``sigma="auto"``) and
        the guard's settings (with ``collapse_guard``) to the seed-log header's ``run_settings``, which a resume
        compares."""
        args, settings = self.trainer.args, header["run_settings"]
        if args.sigma == SIGMA_AUTO:  # the header's sigma is "auto"; each record holds the sigma it used
            settings.update(sigma_target=args.sigma_target, sigma_adapt_steps=args.sigma_adapt_steps,
                            sigma_calibration_prompts=args.sigma_calibration_prompts)
        if args.collapse_guard:
            settings.update({name: getattr(args, name) for name in GUARD_SETTINGS})

    @staticmethod
    def settings_before_they_were_logged(settings: dict) -> dict:
        """The values a checkpoint's ``sigma="auto"`` run used for the settings its header's ``run_settings`` does
        not hold (written by a version without them): the defaults of that version, so a resume compares them too."""
        if "sigma_target" not in settings:  # a fixed sigma, or no sigma="auto" settings logged at all
            return {}
        return {"sigma_adapt_steps": 0, "sigma_calibration_prompts": 0}  # 0: the batch only

    # ------------------------------------------------------------------ sigma="auto"
    def prepare_sigma(self, rows: list[dict], step: int) -> dict:
        """Set ``strategy.sigma`` for this iteration; returns the record's sigma keys (none with a fixed sigma)."""
        if self.trainer.args.sigma != SIGMA_AUTO:
            return {}
        records, every = self.trainer.seed_log.records, self.trainer.args.sigma_adapt_steps
        logged = [r["sigma"] for r in records if "sigma" in r]
        rolled_back = bool(records) and "rollback_to" in records[-1]  # the weights moved: sigma re-adapts to them
        adapt = every > 0 and step % every == 0  # a function of the step only: resume and replay agree
        if logged and not rolled_back and not adapt:  # calibrated earlier in this run (or the one it continues)
            self.trainer.strategy.sigma = float(logged[-1])
            self.trainer._metrics["sigma"].append(self.trainer.strategy.sigma)
            return {"sigma": self.trainer.strategy.sigma}
        members, rows = self._probe_members(step), self.calibration_rows(rows, step)
        start = float(logged[-1]) if logged else START_SIGMA  # a re-calibration starts from the sigma in use
        search, sigma, effect = self._search(members, rows, step, self._greedy_completions(None, rows, step), start)
        self.trainer.strategy.sigma = sigma
        when = " after the rollback" if rolled_back else f" at iteration {step + 1}" if logged else ""
        logger.warning("sigma='auto'%s: sigma = %.6g (%.3f of the probe members' greedy completions on %d prompts "
                       "differ from the center's; target %.3f; probes %s).", when, sigma, effect,
                       self._prompt_count(rows), self.trainer.args.sigma_target,
                       ", ".join(f"{s:.3g}: {e:.3f}" for s, e in search.probes))
        self.trainer._metrics["sigma"].append(sigma)
        self.trainer._metrics["sigma/effect"].append(effect)
        return {"sigma": sigma, "sigma_effect": effect, "sigma_probes": [list(p) for p in search.probes]}

    def measure_sigma_effect(self, sigmas, rows: list[dict] | None = None) -> dict:
        """The effect ``sigma="auto"`` measures, at each of ``sigmas``, on ``rows`` (default: the prompts of the first
        iteration's calibration, :meth:`calibration_rows` of the first training batch), with the first iteration's
        probe members; and the sigma the search picks there.

        Returns:
            `dict`: ``{"effects": [[sigma, effect], ...], "effects_by_measure": {measure: [[sigma, effect], ...]}
            (the effect and two other counts, :meth:`_effects`), "auto": {"sigma", "effect", "probes", "target"},
            "prompts", "members"}``. The model's weights are unchanged.
        """
        if rows is None:
            rows = self.calibration_rows(self.trainer._gather_prompt_rows(
                next(iter(self.trainer.get_train_dataloader()))), 0)
        members = self._probe_members(0)
        center, saved = self._greedy_completions(None, rows, 0), self.trainer.strategy.sigma
        try:
            measured = [self._effects(members, rows, 0, float(s), center) for s in sigmas]
            search, choice, effect = self._search(members, rows, 0, center)
            auto = {"sigma": choice, "effect": effect, "probes": [list(p) for p in search.probes],
                    "target": self.trainer.args.sigma_target}
        finally:
            self.trainer.strategy.sigma = saved
        return {"effects": [[float(s), m["completions"]] for s, m in zip(sigmas, measured, strict=True)],
                "effects_by_measure": {name: [[float(s), m[name]] for s, m in zip(sigmas, measured, strict=True)]
                                       for name in measured[0]} if measured else {},
                "auto": auto, "prompts": self._prompt_count(rows), "members": len(members)}

    def calibration_rows(self, rows: list[dict], step: int) -> list[dict]:
        """The prompt rows a calibration at iteration ``step`` rolls out: ``rows`` (the iteration's) and
        :attr:`draws` rows of ``train_dataset`` (the batch may hold some of them too), drawn without replacement by
        ``numpy.random.default_rng([seed, step])``, so every process, a replay and a resume draw the same ones.
        Under ZeRO-3 each process keeps its contiguous share of the drawn rows, as of a batch."""
        args, dataset, count = self.trainer.args, self.trainer.train_dataset, self.draws
        if count == 0:
            return list(rows)
        if self.trainer.agents.owns_data:  # the environment gives each row's task: more placeholder rows
            return list(rows) + [dataset[0]] * count
        drawn = np.random.default_rng([args.seed, step]).choice(len(dataset), size=count, replace=False)
        if self.trainer.sharded:  # equal shares (self.draws is a multiple of the process count)
            share = count // self.trainer.accelerator.num_processes
            drawn = drawn[self.trainer.accelerator.process_index * share:][:share]
        return list(rows) + [dataset[int(i)] for i in drawn]

    def _prompt_count(self, rows: list[dict]) -> int:
        """The prompts ``rows`` make over all processes (under ZeRO-3 each holds its share)."""
        return len(rows) * (self.trainer.accelerator.num_processes if self.trainer.sharded else 1)

    def _probe_members(self, step: int) -> list[Member]:
        """The first :data:`~trl_es.es.autosigma.PROBE_MEMBERS` members of iteration ``step``."""
        return self.trainer.strategy.ask(step)[: min(PROBE_MEMBERS, self.trainer.args.population_size)]

    def _search(self, members: list[Member], rows: list[dict], step: int, center: RolloutResult,
                start: float = START_SIGMA):
        """Run :class:`~trl_es.es.autosigma.SigmaSearch` to ``sigma_target`` from the probe ``start``; returns
        ``(search, sigma, effect)``: the search with its probes, the sigma it picks and the effect measured there
        (``strategy.sigma`` is left at that sigma)."""
        search = SigmaSearch(self.trainer.args.sigma_target, start=start)
        while (sigma := search.next_sigma()) is not None:
            search.tell(sigma, self._effect(members, rows, step, sigma, center))
        sigma = search.choice()
        return search, sigma, self._effect(members, rows, step, sigma, center)

    def _greedy_rollout(self):
        """The rollout with greedy decoding and one completion per row (agent rollouts as they are)."""
        rollout = self.trainer.rollout
        if not isinstance(rollout, Rollout):
            return rollout
        config = copy.deepcopy(self.trainer.generation_config)
        config.do_sample = False
        return dataclasses.replace(rollout, generation_config=config, num_generations=1)

    def _greedy_completions(self, chunk_members: list[Member] | None, rows: list[dict], step: int) -> RolloutResult:
        """The greedy rollout of ``rows`` (completion ids and rewards) with the center (``None``) or with stacked
        ``chunk_members`` applied, member after member."""
        model = self.trainer.accelerator.unwrap_model(self.trainer.model)
        self.trainer._prepare_forward_precision()
        kwargs = {"trainer_state": self.trainer.state, "log_extra": lambda *a, **k: None,
                  "log_metric": lambda *a, **k: None}
        rollout = self._greedy_rollout()
        if chunk_members is None:
            self.trainer._sync_model_view()
            return rollout(model, rows, reward_kwargs=kwargs)
        with self.trainer.strategy.apply(chunk_members, model):
            self.trainer._sync_model_view()
            return rollout(model, rows * len(chunk_members), num_members=len(chunk_members), reward_kwargs=kwargs)

    def _effect(self, members: list[Member], rows: list[dict], step: int, sigma: float,
                center: RolloutResult) -> float:
        """The effect: the fraction of the probe members' greedy completions that differ from the center's."""
        return self._effects(members, rows, step, sigma, center)["completions"]

    def _effects(self, members: list[Member], rows: list[dict], step: int, sigma: float,
                 center: RolloutResult) -> dict[str, float]:
        """At ``sigma``, the fractions of the probe members' greedy completions that differ from the center's on the
        same prompt (``"completions"``, the effect), whose reward differs (``"rewards"``), and that differ among the
        prompts whose center completion ended before the token limit (``"ended_completions"``, NaN if none did),
        counted over all
        processes (each rolls out its members, or under ZeRO-3 its prompts). The last two are diagnostics
        (:meth:`measure_sigma_effect`)."""
        self.trainer.strategy.sigma = sigma
        if self.trainer.sharded:
            indices = list(range(len(members)))
        else:
            accelerator = self.trainer.accelerator
            indices = member_indices(len(members), accelerator.process_index, accelerator.num_processes)
        # completions that differ, rewards that differ, completions; of the rows the center ended: differ, completions
        counts = torch.zeros(5, dtype=torch.float64)
        ended = [k for k, t in enumerate(center.terminated) if t]
        chunks = list(self.trainer.strategy.chunks(indices))
        # several vLLM servers: chunks on each, as the members' rollouts
        rolled = self.trainer.generation_engine.map_chunks(
            lambda chunk: self._greedy_completions([members[i] for i in chunk], rows, step), chunks)
        width = len(center.completion_ids)
        for chunk, result in zip(chunks, rolled, strict=True):
            blocks = range(len(chunk))
            ids, rewards = result.completion_ids, result.rewards.tolist()
            differ, total = differing_completions(center.completion_ids, [ids[k * width : (k + 1) * width]
                                                                          for k in blocks])
            flipped, _ = differing_rewards(center.rewards.tolist(), [rewards[k * width : (k + 1) * width]
                                                                     for k in blocks])
            kept, kept_total = differing_completions([center.completion_ids[r] for r in ended],
                                                     [[ids[k * width + r] for r in ended] for k in blocks])
            counts += torch.tensor([differ, flipped, total, kept, kept_total], dtype=torch.float64)
        if self.trainer.accelerator.num_processes > 1:
            counts = self.trainer.accelerator.reduce(counts.to(self.trainer.accelerator.device), reduction="sum").cpu()
            self.trainer._comm_bytes += counts.numel() * 8
        total, total_ended = float(counts[2]), float(counts[4])
        return {"completions": float(counts[0]) / total if total else 0.0,
                "rewards": float(counts[1]) / total if total else 0.0,
                "ended_completions": float(counts[3]) / total_ended if total_ended else float("nan")}  # none ended

    # ------------------------------------------------------------------ the collapse guard
    def _guard(self) -> CollapseGuard:
        """The guard's state after the seed log's records."""
        args = self.trainer.args
        return CollapseGuard.from_records(self.trainer.seed_log.records, threshold=args.collapse_guard_threshold,
                                          patience=args.collapse_guard_patience,
                                          alpha_factor=args.collapse_guard_alpha_factor)

    def step_or_rollback(self, members: list[Member], scores: PopulationScores, step: int,
                          learning_rate: float) -> tuple[TellResult, list[Member], dict, list[float]]:
        """The iteration's update: the ES step (``_tell``), or with the guard on and a collapse, a rollback.

        Returns:
            ``(told, record_members, extra, shaped)``: what the seed log records (``told`` and the members of the
            record, the extra record keys) and the members' shaped fitness (for the completion log).
        """
        fitness = scores.per_prompt_fitness(self.trainer.args.per_prompt_shaping)
        if not self.trainer.args.collapse_guard:
            told = self.trainer._tell(members, fitness, learning_rate)
            return told, members, {}, told.coefficients
        guard = self._guard()
        count = float(scores.reward_count.sum())
        square = float(scores.reward_sq_sum.sum()) if scores.reward_sq_sum is not None else 0.0
        mean, se = mean_and_se(float(scores.reward_sum.sum()), square, count, self.trainer.args.population_size)
        extra = {"fitness_mean": mean, "fitness_se": se}
        if guard.observe(len(self.trainer.seed_log.records), mean, se):
            best = guard.best
            rollback = guard.rollback(self.trainer.seed_log.records)
            undo = [Member(seed, sign) for seed, sign in rollback.members]
            trainer = self.trainer
            es_update_(trainer.es_params, trainer.strategy.perturbation, trainer.noise, undo, rollback.coefficients,
                       rollback.learning_rate)
            logger.warning(
                "Collapse guard: iteration %d's mean reward %.4f (standard error %.4f) is the last of %d in a row "
                "below the best %.4f by more than %g standard errors: rolled back to the weights after step %d "
                "(undoing steps %s); learning rate now x%g.", step + 1, mean, se, guard.patience, best[0],
                guard.threshold, rollback.to_state, rollback.undone, guard.alpha_scale)
            extra.update({"rollback_to": rollback.to_state, "undone": rollback.undone})
            self.trainer._metrics["es/rollbacks"].append(float(guard.rollbacks))
            shaped = shape_fitness(fitness, self.trainer.args.fitness_shaping).tolist()
            return TellResult(rollback.coefficients, rollback.learning_rate, 0.0), undo, extra, shaped
        self.trainer._metrics["es/rollbacks"].append(float(guard.rollbacks))
        told = self.trainer._tell(members, fitness, learning_rate * guard.alpha_scale)
        return told, members, extra, told.coefficients


def stability_field_errors(args) -> list[str]:
    """The errors of ``sigma`` (a number > 0 or ``"auto"``; a numeric string, as a command line gives it, becomes a
    float) and of ``sigma_target``, ``sigma_adapt_steps``, ``sigma_calibration_prompts`` and the ``collapse_guard*``
    fields, each naming the field and its allowed values."""
    errors = []
    sigma = args.sigma
    if isinstance(sigma, str) and sigma != SIGMA_AUTO:
        try:
            sigma = float(sigma)
        except ValueError:
            pass
        else:
            args.sigma = sigma
    number = not isinstance(sigma, (bool, str)) and isinstance(sigma, (int, float)) and 0 < sigma < float("inf")
    if sigma != SIGMA_AUTO and not number:
        errors.append(f"sigma must be > 0 (a number) or {SIGMA_AUTO!r}, got {sigma!r}.")
    if not isinstance(args.sigma_target, (int, float)) or not 0 < args.sigma_target < 1:
        errors.append(f"sigma_target must be in (0, 1) (a fraction of completions), got {args.sigma_target!r}.")
    every = args.sigma_adapt_steps
    if isinstance(every, bool) or not isinstance(every, int) or every < 0:
        errors.append(f"sigma_adapt_steps must be an integer >= 0 (iterations; 0: no periodic re-calibration), got "
                      f"{every!r}.")
    elif every > 0 and sigma != SIGMA_AUTO:
        errors.append(f"sigma_adapt_steps={every} needs sigma='auto' (a fixed sigma is not re-calibrated), got "
                      f"sigma={sigma!r}.")
    count = args.sigma_calibration_prompts
    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
        errors.append(f"sigma_calibration_prompts must be an integer >= 0 (the prompts a sigma='auto' calibration "
                      f"rolls out; at most prompt_batch_size: the batch alone), got {count!r}.")
    if not isinstance(args.collapse_guard_threshold, (int, float)) or not args.collapse_guard_threshold > 0:
        errors.append(f"collapse_guard_threshold must be > 0 (standard errors), got {args.collapse_guard_threshold!r}.")
    patience = args.collapse_guard_patience
    if isinstance(patience, bool) or not isinstance(patience, int) or patience < 1:
        errors.append(f"collapse_guard_patience must be an integer >= 1, got {patience!r}.")
    factor = args.collapse_guard_alpha_factor
    if not isinstance(factor, (int, float)) or not 0 < factor <= 1:
        errors.append(f"collapse_guard_alpha_factor must be in (0, 1], got {factor!r}.")
    if args.collapse_guard and args.es_optimizer != "es":
        errors.append("collapse_guard=True needs es_optimizer='es': a rollback undoes ES steps, not a torch "
                      "optimizer's state.")
    if args.collapse_guard and args.awd_lambda > 0:
        errors.append("collapse_guard=True needs awd_lambda=0: a rollback undoes the ES steps, and AWD's decay "
                      "toward theta_0 cannot be undone exactly.")
    return errors
