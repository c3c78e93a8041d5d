import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
# the study scripts' helper package _study, found as `python examples/studies/<script>.py` finds it (appended: a
# script's name never shadows an installed module)
sys.path.append(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "studies"))

from example_script import StudyRun, example_script  # noqa: E402
from tiny import build_llama, build_qwen2, build_tokenizer  # noqa: E402
from warm_python import WarmPython  # noqa: E402

# Tests run their jobs on tiny local models: trl_es.launch must not build the embedded model's cache in the user's
# cache folder before each multi-process worker (the tests of that step clear this variable).
os.environ["TRL_ES_NO_EMBEDDED_CACHE"] = "1"

# The heaviest test files, heaviest first (pytest --durations on 2 cores). scripts/run_tests.sh runs `-n 2 --dist
# loadfile`: a file stays on one worker (its module fixtures built once), and the long files start first, so that the
# two workers end together instead of one running a long file alone at the end.
HEAVY_FIRST = (
    "tests/trainer/test_distributed.py", "tests/trainer/test_es_trainer.py", "tests/examples/test_grpo_scripts.py",
    "tests/examples/test_trl_docs_scripts.py", "tests/generation/test_continuous_batching.py",
    "tests/trainer/test_preemption.py", "tests/test_models.py", "tests/trainer/test_launch_world.py",
    "tests/trainer/test_multinode.py", "tests/trainer/test_stability.py",
    "tests/es/test_portability.py",
    "tests/trainer/test_awd.py", "tests/examples/test_hyper_es_script.py", "tests/trainer/test_resume_trust.py",
    "tests/trainer/test_trl_conformance.py", "tests/generation/test_vllm_server_worker.py",
    "tests/benchmarks/test_benchmarks.py", "tests/examples/test_compare_script.py",
    "tests/examples/test_agents_study.py", "tests/trainer/test_config_fields.py", "tests/trainer/test_agents.py",
)


def pytest_collection_modifyitems(session, config, items):
    rank = {path: i for i, path in enumerate(HEAVY_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))  # stable: the rest keep their order


@pytest.fixture(scope="session")
def tokenizer():
    return build_tokenizer()


@pytest.fixture
def tiny_llama(tokenizer):
    return build_llama(tokenizer)


@pytest.fixture
def tiny_qwen2(tokenizer):
    return build_qwen2(tokenizer)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, tokenizer):
    """A tiny Llama and its tokenizer saved to disk, for code paths that take a model path."""
    path = tmp_path_factory.mktemp("tiny-llama")
    build_llama(tokenizer).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def study(request):
    """``examples/studies/<STUDY>.py``, the study script the test module names in ``STUDY``, imported as a module."""
    name = request.module.STUDY
    with example_script(f"studies/{name}.py", name) as module:
        yield module


@pytest.fixture
def run_study(study, tiny_model_dir, tmp_path):
    """The study's ``main`` run in-process on the tiny model: ``run_study(*argv)`` writes into ``run_study.output_dir``
    (``tmp_path / "run"``)."""
    return StudyRun(study, tiny_model_dir, tmp_path / "run")


class _SessionWarmPython:
    """:class:`WarmPython`'s ``run`` and ``run_ranks``, its server started on first use and started again after one
    was stopped (a timed-out script stops it)."""

    def __init__(self, env: dict):
        self.env, self.warm = env, None

    def _server(self) -> WarmPython:
        if self.warm is None or self.warm.server.poll() is not None:
            self.warm = WarmPython(self.env)
        return self.warm

    def run(self, *args, **kwargs):
        return self._server().run(*args, **kwargs)

    def run_ranks(self, *args, **kwargs):
        return self._server().run_ranks(*args, **kwargs)

    def close(self):
        if self.warm is not None:
            self.warm.close()


@pytest.fixture(scope="session")
def warm_python():
    """One warm interpreter per pytest worker (tests/warm_python.py) for the tests that run ``python script.py`` or
    ``python -m module`` (the study arms, example and benchmark scripts, the CLI): started on first use, with this
    process's environment, one thread per process (``OMP_NUM_THREADS=1``); a test passes any other variables as
    ``env``."""
    warm = _SessionWarmPython(dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false"))
    yield warm
    warm.close()


@pytest.fixture
def one_thread():
    """Run a test on one intra-op thread (tiny models: thread start-up costs more than it gains)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# torch.compile on CPU (inductor's C++ kernels) does not build with torch's dispatch forced to the scalar kernels
# (ATEN_CPU_CAPABILITY=default: "'at::vec' has not been declared", torch 2.13): the compiled engine is for GPUs, and the
# CPU default ("auto") is the eager engine, so its CPU tests run only where inductor can build.
needs_inductor_vectorized_cpu = pytest.mark.skipif(
    torch.backends.cpu.get_cpu_capability() == "DEFAULT",
    reason="torch inductor's C++ build fails with ATEN_CPU_CAPABILITY=default (torch 2.13)",
)
