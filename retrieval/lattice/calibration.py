"""Latent relevance from listwise slate scores: LATTICE's calibration across slates.

A scorer rates each slate on its own scale: the same node can get 70 in a weak slate and 40 in a
strong one. LATTICE models every observed score as ``s = a * s_hat(node) + b(slate)`` and fits the
latent ``s_hat`` by least squares over the whole score history, refitted after each batch of slates.

Conventions (the paper leaves them open; the released code fits with 200 AdamW steps from a random start
and pins nothing):

* ``a`` only trades scale with ``s_hat``, so it is fixed at 1 and ``s_hat`` stays on the scorer's own
  0-1 scale (raw score / 100), which is also the scale of the root's path relevance (1.0).
* A constant can move between ``s_hat`` and the slate biases; a small ridge on the biases pins it (the
  biases of slates linked by shared nodes average 0), so every system is non-singular, slates with no
  node in common need no special case, and a single slate's scores come back as they were given.
* The fit is one closed-form solve (``numpy.linalg.lstsq``, which also returns the minimum-norm answer
  for a degenerate system rather than dividing by zero).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Observation:
    """One score a scorer gave: ``node`` rated ``score`` (0-1) in slate ``slate``."""

    slate: Hashable
    node: Hashable
    score: float


@dataclass(frozen=True)
class LatentFit:
    """The fitted latent score of every node seen and the bias of every slate."""

    node_scores: dict[Hashable, float]
    slate_bias: dict[Hashable, float]


def fit_latent_scores(observations: Sequence[Observation], bias_ridge: float = 1e-2) -> LatentFit:
    """Least-squares fit of ``score = s_hat(node) + b(slate)`` with ``bias_ridge * sum(b^2)`` added.

    >>> obs = [Observation("s1", "x", 0.9), Observation("s1", "y", 0.5),
    ...        Observation("s2", "y", 0.3), Observation("s2", "z", 0.1)]
    >>> fit = fit_latent_scores(obs, bias_ridge=1e-6)
    >>> round(fit.node_scores["x"] - fit.node_scores["z"], 3)  # y links the slates: 0.4 + 0.2
    0.6
    """
    if bias_ridge <= 0:
        raise ValueError(f"bias_ridge must be > 0 to pin the constant, got {bias_ridge}")
    if not observations:
        return LatentFit({}, {})
    nodes = list(dict.fromkeys(o.node for o in observations))
    slates = list(dict.fromkeys(o.slate for o in observations))
    node_col = {n: i for i, n in enumerate(nodes)}
    slate_col = {s: len(nodes) + i for i, s in enumerate(slates)}
    n_obs, n_unknowns = len(observations), len(nodes) + len(slates)
    design = np.zeros((n_obs + len(slates), n_unknowns))
    target = np.zeros(n_obs + len(slates))
    for row, o in enumerate(observations):
        design[row, node_col[o.node]] = 1.0
        design[row, slate_col[o.slate]] = 1.0
        target[row] = o.score
    ridge = np.sqrt(bias_ridge)
    for i, s in enumerate(slates):  # ridge rows: sqrt(lambda) * b_s = 0
        design[n_obs + i, slate_col[s]] = ridge
    solution, *_ = np.linalg.lstsq(design, target, rcond=None)
    return LatentFit(node_scores={n: float(solution[node_col[n]]) for n in nodes},
                     slate_bias={s: float(solution[slate_col[s]]) for s in slates})
