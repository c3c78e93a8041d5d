"""pass@k as a Hugging Face `evaluate` metric module (``trl_es.analysis.load_pass_at_k_metric()`` loads it offline)."""

import datasets
import evaluate

# The one implementation of the estimator, pure numpy; evaluate.load copies this relative import along. No comment on
# the import line itself: evaluate would read it as the URL of an external file.
from .estimator import estimate_pass_at_k


_CITATION = """\
@article{chen2021codex,
  title={Evaluating Large Language Models Trained on Code},
  author={Mark Chen and Jerry Tworek and Heewoo Jun and Qiming Yuan and Henrique Ponde de Oliveira Pinto and others},
  journal={arXiv preprint arXiv:2107.03374},
  year={2021}
}
"""

_DESCRIPTION = """\
Unbiased pass@k estimator of Chen et al. (2021), Sec. 2.1. For a problem with n samples of which c are correct,
pass@k = 1 - C(n-c, k) / C(n, k), computed in the numerically stable product form
1 - prod_{i=n-c+1}^{n} (1 - k/i); the metric is the mean over problems. Each problem is given by counts, so the
samples can be judged by any verifier (unit tests, a math checker, a reward function).
"""

_KWARGS_DESCRIPTION = """
Args:
    predictions (list of int): number of correct samples c for each problem (0 <= c <= n).
    references (list of int): number of samples n drawn for each problem (n >= 1).
    k (int or list of int, default [1]): the budgets; every k must satisfy 1 <= k <= n for every problem
        (a ValueError names the offending value otherwise).
Returns:
    dict: {"pass@k": float} for each requested k, the mean over problems of the unbiased estimate.
Examples:
    >>> metric = trl_es.analysis.load_pass_at_k_metric()
    >>> metric.compute(predictions=[3, 0], references=[10, 10], k=[1, 5])
    {'pass@1': 0.15000000000000002, 'pass@5': 0.4583333333333333}
"""


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class PassAtK(evaluate.Metric):
    """Unbiased pass@k (Chen et al. 2021) from per-problem counts of correct samples."""

    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation=_CITATION,
            inputs_description=_KWARGS_DESCRIPTION,
            # per problem: predictions c correct of references n samples
            features=datasets.Features({"predictions": datasets.Value("int64"), "references": datasets.Value("int64")}),
            reference_urls=["https://arxiv.org/abs/2107.03374"],
        )

    def _compute(self, predictions, references, k=None):
        ks = [1] if k is None else ([k] if isinstance(k, int) else list(k))  # one k or a list; default [1]
        if len(ks) == 0:
            raise ValueError("`k` must be an int or a non-empty list of ints.")
        return {f"pass@{kk}": float(estimate_pass_at_k(references, predictions, kk).mean()) for kk in ks}
