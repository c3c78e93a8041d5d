"""ES on a plain ``nn.Module``, without TRL: a small MLP learns XOR with the strategy object of ``trl_es.es``.

The same ask / apply / tell loop ``ESTrainer.training_step`` runs on an LLM (``docs/architecture.md``).

Usage:
    python examples/scripts/es_xor.py --iterations 300
"""

import argparse

import torch
from torch import nn

from trl_es.es.strategy import EvolutionStrategy


INPUTS = torch.tensor([[0.0, 0.0], [0.0, 1.0], [1.0, 0.0], [1.0, 1.0]])
TARGETS = torch.tensor([0.0, 1.0, 1.0, 0.0])


def fitness_of(model: nn.Module) -> float:
    """Negative mean squared error on the four XOR cases (higher is better)."""
    with torch.no_grad():
        return -float((model(INPUTS).squeeze(-1) - TARGETS).pow(2).mean())


def accuracy_of(model: nn.Module) -> float:
    with torch.no_grad():
        return float(((model(INPUTS).squeeze(-1) > 0.5).float() == TARGETS).float().mean())


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=300)
    parser.add_argument("--population_size", type=int, default=32)
    parser.add_argument("--sigma", type=float, default=0.1)
    parser.add_argument("--learning_rate", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    torch.manual_seed(args.seed)
    model = nn.Sequential(nn.Linear(2, 16), nn.Tanh(), nn.Linear(16, 1), nn.Sigmoid())
    strategy = EvolutionStrategy.for_module(model, sigma=args.sigma, population_size=args.population_size,
                                            seed=args.seed, antithetic=True)
    start = fitness_of(model)
    for step in range(args.iterations):
        members = strategy.ask(step)  # seeds and signs: nothing else travels
        fitness = []
        for chunk in strategy.chunks(range(len(members))):
            with strategy.apply([members[i] for i in chunk], model):  # theta + sigma * eps_i, restored on exit
                fitness.append(fitness_of(model))
        strategy.tell(members, torch.tensor(fitness), args.learning_rate)  # z-scored fitness -> ES step
        if step % 50 == 0 or step == args.iterations - 1:
            print(f"iteration {step + 1:4d}  fitness {fitness_of(model):+.4f}  accuracy {accuracy_of(model):.2f}")
    result = {"start_fitness": start, "fitness": fitness_of(model), "accuracy": accuracy_of(model)}
    print(result)
    return result


if __name__ == "__main__":
    main()
