"""The member loop of an ask/tell population, as ESTrainer runs it, for tests that drive a backend directly."""


def score_population(backend, params, noise, members, indices, sigma, score, model=None) -> dict:
    """For each group of ``backend.chunks(indices)``: apply the group's members, then ``score(group)`` (a dict
    ``{index: value}``); the model is restored when the ``with`` ends, also if ``score`` raises."""
    results = {}
    for group in backend.chunks(indices):
        with backend.apply(params, noise, [members[i] for i in group], sigma, model):
            results.update(score(group))
    return results
