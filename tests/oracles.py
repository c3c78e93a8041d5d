"""The tests' oracles: what a member or a sampler should compute, written out independently of the package's code."""

import copy
import math

import torch

from trl_es.es.noise import full_noise
from trl_es.es.perturbation import Member, select_parameters


LINEARS = r"(proj|lm_head)\.weight$"  # every nn.Linear weight of the tiny Llama and Qwen2 (tests/tiny.py)


def members3() -> list[Member]:
    """An antithetic pair and a third member: 3 members, so 3 row blocks."""
    return [Member(11, 1), Member(11, -1), Member(29, 1)]


def materialized(model, noise, member, sigma, rank, include=LINEARS):
    """A copy of ``model`` with ``W + sign * (sigma / sqrt(r)) * A @ B^T`` written into every weight ``include``
    selects: the dense low-rank member (EGGROLL, arXiv 2511.16652).

    ``A`` (out x r) and ``B`` (in x r) are read straight from the noise source by their documented tensor names,
    independently of the backend's own factor code; the product is formed in float64, then cast to the weight's dtype.
    """
    twin = copy.deepcopy(model)
    with torch.no_grad():
        for name, p in select_parameters(twin, include):
            out_features, in_features = p.shape
            a = full_noise(noise, member.seed, name + ".lowrank_A", (out_features, rank)).double()
            b = full_noise(noise, member.seed, name + ".lowrank_B", (in_features, rank)).double()
            p.add_((member.sign * sigma / math.sqrt(rank) * (a @ b.T)).to(p.dtype))
    return twin


def nucleus_probabilities(scores, temperature, top_p):
    """transformers' own sampling distribution: temperature, then TopPLogitsWarper, then softmax."""
    from transformers import TemperatureLogitsWarper, TopPLogitsWarper

    ids = torch.zeros(scores.shape[0], 1, dtype=torch.long)
    warped = TemperatureLogitsWarper(temperature)(ids, scores.clone())
    if top_p < 1:
        warped = TopPLogitsWarper(top_p)(ids, warped)
    return warped.softmax(dim=-1)
