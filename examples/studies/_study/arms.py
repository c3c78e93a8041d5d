"""The orchestration the study scripts share: parsing their arguments, running their arms as jobs (in this process or
in ``trl_es.launch`` worker processes), reusing a job's saved result, and writing ``results.json`` / ``results.md``."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class JobArguments:
    """The arguments of a study that runs its arms as jobs, each in its own process tree or all in this process."""

    eval_workers: int | None = field(default=None, metadata={
        "help": "Evaluation jobs at once, one process each (default: GPUs, else physical cores)."})
    in_process: bool = field(default=False, metadata={"help": "Run every job in this process (tests; one GPU)."})
    reuse: bool = field(default=True, metadata={
        "help": "Skip a job whose result file holds the same spec (resume an interrupted run)."})
    worker: str | None = field(default=None, metadata={"help": "Internal: run one job from a spec file."})


class Jobs:
    """The jobs of one study script: a job is a spec (a dict with ``"result"``, the JSON file it writes, and ``"args"``,
    the script's arguments) that ``job(spec)`` runs here or ``python script --worker spec.json`` runs in a worker.

    Args:
        script (`str`): The study script's path (``__file__``).
        tag (`str`): The prefix of its progress lines (``"awd"``).
        not_in_result (`tuple[str, ...]`): Arguments that choose which jobs exist, not what a job computes: a saved
            result stays reusable when they change (with ``reuse`` and ``worker``, which never change a result).
    """

    def __init__(self, script: str, tag: str, not_in_result: tuple[str, ...] = ()):
        self.script, self.tag = os.path.abspath(script), tag
        self.not_in_result = ("reuse", "worker", *not_in_result)

    def reusable(self, spec: dict, reuse: bool = True) -> dict | None:
        """The result ``spec``'s file already holds for the same spec (ignoring ``not_in_result``), else ``None``."""
        from trl_es.launch import reusable_result

        return reusable_result(spec, reuse, self.not_in_result)

    def run(self, args: JobArguments, spec: dict, job: Callable[[dict], dict], processes: int | None = None,
            message: str = "") -> dict:
        """``spec``'s result: reused, else ``job(spec)`` here (``args.in_process``) or in a worker of ``processes``."""
        from trl_es.launch import run_worker

        result = self.reusable(spec, args.reuse)
        if result is None:
            if message:
                print(f"[{self.tag}] {message}", flush=True)
            result = job(spec) if args.in_process else run_worker(self.script, spec, processes)
        return result

    def run_all(self, args: JobArguments, specs: list[dict], job: Callable[[dict], dict], what: str) -> list[dict]:
        """Every spec's result: those not reusable run here one after another, or ``args.eval_workers`` at once.
        ``what`` is the progress line, ``{}`` standing for the number of jobs that run."""
        from trl_es.launch import run_workers

        todo = [s for s in specs if self.reusable(s, args.reuse) is None]
        print(f"[{self.tag}] {what.format(len(todo))}", flush=True)
        if args.in_process:
            for spec in todo:
                job(spec)
        elif todo:
            run_workers(self.script, todo, args.eval_workers)
        return [self.reusable(s) for s in specs]


def settings_of(args, not_in_result: tuple[str, ...] = ()) -> dict:
    """What a study's saved result was made from: ``args`` (a dataclass) as a dict, less ``reuse``, ``output_dir`` and
    ``not_in_result`` (the arguments that choose which results exist, such as ``seeds``)."""
    ignored = ("reuse", "output_dir", *not_in_result)
    return {k: v for k, v in dataclasses.asdict(args).items() if k not in ignored}


def saved_result(path: str, settings: dict, reuse: bool = True) -> dict | None:
    """The JSON saved at ``path`` when ``reuse`` is on and its ``"settings"`` equal ``settings``; else ``None``."""
    if not reuse or not os.path.exists(path):
        return None
    with open(path) as f:
        saved = json.load(f)
    return saved if saved.get("settings") == settings else None


def parse_arguments(cls: type, argv: list[str] | None = None):
    """``cls`` (a dataclass) from ``argv`` (default: ``sys.argv[1:]``), with ``--config file.yaml`` support."""
    from trl_es.arguments import TrlESParser

    (args,) = TrlESParser((cls,)).parse_args_and_config(args=list(sys.argv[1:] if argv is None else argv))
    return args


def write_results(output_dir: str, results: dict, markdown: str, plot: Callable[[], None] | None = None) -> None:
    """``results.json``, ``results.md`` and the plots (``plot()``) in ``output_dir`` from the main process, which
    prints the table."""
    from trl_es.files import is_main_process, write_json, write_text

    if is_main_process():
        write_json(os.path.join(output_dir, "results.json"), results)
        write_text(os.path.join(output_dir, "results.md"), markdown)
        if plot is not None:
            plot()
        print(markdown, flush=True)
