"""Which files of the ``trl_es`` package one ES iteration passes through, and how many functions in each::

    python scripts/iteration_files.py          # files in the order of their first call, functions per file
    python scripts/iteration_files.py --all    # and every function called, per file

An :class:`~trl_es.ESTrainer` with the default :class:`~trl_es.ESConfig` settings (only the sizes are small:
population 4, 2 prompts, 4 completion tokens, a 2^20-entry noise table, the smallest allowed; sizes change no code
path) trains the tiny local Llama (``tests/tiny.py``) with a one-line reward (mean character code) for 2 iterations.
The first warms up (lazy imports, first-iteration checks); the second is traced with :func:`sys.setprofile` (and
:func:`threading.setprofile`, for the reward loop's threads) from the start of ``training_step`` to its return: every
Python ``call`` event whose code lives under the package directory counts, once per distinct function (file,
qualified name, first line); comprehensions and generator expressions are counted with the function they sit in.
``es_update_`` (``es/perturbation.py``) is inside the window. Issue 59's target: at most 10 files.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
import threading


_COMPREHENSIONS = {"<listcomp>", "<dictcomp>", "<setcomp>", "<genexpr>"}  # parts of the function that holds them
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _reward(completions, **kwargs) -> list[float]:
    """Mean character code / 128: a reward that differs between almost any two completions."""
    return [sum(map(ord, c)) / (128 * max(1, len(c))) for c in completions]


def trace_iteration(output_dir: str, **overrides) -> dict[str, list[str]]:
    """Train 2 iterations (``overrides``: ESConfig fields other than the defaults); return ``{relative file:
    [qualified function names, in first-call order]}`` of the second iteration's ``training_step``, files in the order
    of their first call (paths relative to the package's parent)."""
    sys.path.insert(0, os.path.join(REPO, "tests"))
    from datasets import Dataset
    from tiny import build_llama, build_tokenizer

    import trl_es
    from trl_es import ESConfig, ESTrainer

    package = os.path.dirname(os.path.abspath(trl_es.__file__)) + os.sep
    root = os.path.dirname(package.rstrip(os.sep)) + os.sep
    seen: dict[str, dict[str, None]] = {}  # dicts: insertion-ordered sets

    def profile(frame, event, arg):
        if event == "call":
            code = frame.f_code
            if code.co_filename.startswith(package) and code.co_name not in _COMPREHENSIONS:
                name = f"{code.co_qualname}:{code.co_firstlineno}"
                seen.setdefault(code.co_filename[len(root):], {})[name] = None

    tokenizer = build_tokenizer()
    args = ESConfig(output_dir=output_dir, max_steps=2, population_size=4, prompt_batch_size=2,
                    max_completion_length=4, noise_table_size=1 << 20, report_to=[], save_strategy="no",
                    disable_tqdm=True, **overrides)
    trainer = ESTrainer(build_llama(tokenizer), _reward, args=args, processing_class=tokenizer,
                        train_dataset=Dataset.from_dict({"prompt": [f"Write: {i}" for i in range(4)]}))
    step = trainer.training_step
    calls = []

    def traced_step(*a, **k):
        calls.append(None)
        if len(calls) != 2:  # the first iteration warms up
            return step(*a, **k)
        threading.setprofile(profile)
        sys.setprofile(profile)
        try:
            return step(*a, **k)
        finally:
            sys.setprofile(None)
            threading.setprofile(None)

    trainer.training_step = traced_step
    trainer.train()
    if len(calls) != 2:
        raise RuntimeError(f"expected 2 iterations, ran {len(calls)}")
    return {file: list(names) for file, names in seen.items()}


def table(files: dict[str, list[str]], show_all: bool = False) -> str:
    """The files with their function counts, then the totals; with ``show_all`` each file's functions below it."""
    width = max(len(f) for f in files)
    lines = [f"{'file (order of first call)':<{width}}  functions"]
    for file, names in files.items():
        lines.append(f"{file:<{width}}  {len(names):>9}")
        if show_all:
            lines.extend(f"    {name}" for name in names)
    lines.append(f"{'total: ' + str(len(files)) + ' files':<{width}}  {sum(map(len, files.values())):>9}")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--all", action="store_true", help="list every function called, per file")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as output_dir, contextlib.redirect_stdout(sys.stderr):  # the trainer's logs
        files = trace_iteration(output_dir)
    print(table(files, args.all))


if __name__ == "__main__":
    main()
