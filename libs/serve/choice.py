"""Constrained choice: answer with one of a few given strings, picked by the model.

vLLM's `guided_choice` masks decoding to the choices' token trie; here each choice's token
sequence (its text, then the stop id that ends the turn, so "yes" and "yes, but" are told
apart) is scored under the model given the prompt, in one forward pass for all choices,
and the pick is made over whole sequences:

- temperature 0: the most probable sequence (argmax of summed token logprobs);
- otherwise: sampled with probability softmax(sequence logprob / temperature) over the
  choices, so temperature 1 samples by the sequences' probabilities renormalized to the
  choices. `top_p` does not apply.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence


def choice_probabilities(sequence_logprobs: Sequence[float], temperature: float) -> list[float]:
    """Probability of picking each choice; a point mass on the first best one at 0."""
    if not sequence_logprobs:
        raise ValueError("no choices to pick from")
    if temperature == 0:
        best = max(range(len(sequence_logprobs)), key=lambda i: sequence_logprobs[i])
        return [1.0 if i == best else 0.0 for i in range(len(sequence_logprobs))]
    scaled = [logprob / temperature for logprob in sequence_logprobs]
    top = max(scaled)
    weights = [math.exp(value - top) for value in scaled]
    total = sum(weights)
    return [weight / total for weight in weights]


def pick_choices(
    sequence_logprobs: Sequence[float], temperature: float, num_picks: int, seed: int | None
) -> list[int]:
    """Indices of `num_picks` independent picks (seeded when `seed` is set)."""
    probabilities = choice_probabilities(sequence_logprobs, temperature)
    rng = random.Random(seed)
    return rng.choices(range(len(probabilities)), weights=probabilities, k=num_picks)
