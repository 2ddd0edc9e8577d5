"""LATTICE's latent-score fit: synthetic slates with known latent scores and slate biases (synthetic numbers are
the point: only they have a known answer)."""

from __future__ import annotations

import numpy as np
import pytest

from overstory.retrieval.lattice.calibration import Observation, fit_latent_scores


def synthetic(n_nodes=60, n_slates=25, slate_size=8, noise=0.0, seed=0):
    rng = np.random.default_rng(seed)
    truth = {f"n{i}": float(rng.uniform(0, 1)) for i in range(n_nodes)}
    observations = []
    for s in range(n_slates):
        bias = float(rng.normal(0, 0.25))
        for i in rng.choice(n_nodes, slate_size, replace=False):
            observations.append(Observation(f"s{s}", f"n{i}", truth[f"n{i}"] + bias + float(rng.normal(0, noise))))
    return truth, observations


def centred(values):
    values = np.asarray(values)
    return values - values.mean()


def test_recovers_latent_scores_up_to_a_constant():
    truth, observations = synthetic()
    fit = fit_latent_scores(observations, bias_ridge=1e-4)
    seen = list(fit.node_scores)
    error = centred([fit.node_scores[n] for n in seen]) - centred([truth[n] for n in seen])
    assert np.abs(error).max() < 0.01
    # the raw scores alone are off by the slate biases: calibration is what removes them
    raw = {}
    for o in observations:
        raw.setdefault(o.node, []).append(o.score)
    raw_error = centred([np.mean(raw[n]) for n in seen]) - centred([truth[n] for n in seen])
    assert np.abs(raw_error).max() > 10 * np.abs(error).max()


def test_noisy_scores_still_rank_nodes_better_than_raw_means():
    truth, observations = synthetic(noise=0.05, seed=1)
    fit = fit_latent_scores(observations)
    seen = list(fit.node_scores)
    raw = {}
    for o in observations:
        raw.setdefault(o.node, []).append(o.score)
    t = [truth[n] for n in seen]
    calibrated = np.corrcoef(t, [fit.node_scores[n] for n in seen])[0, 1]
    assert calibrated > np.corrcoef(t, [np.mean(raw[n]) for n in seen])[0, 1]


def test_degenerate_histories_do_not_divide_by_zero():
    assert fit_latent_scores([]).node_scores == {}
    single = [Observation("s", "a", 0.7), Observation("s", "b", 0.2)]  # one slate: scores come back as given
    fit = fit_latent_scores(single, bias_ridge=1e-6)
    assert fit.node_scores == pytest.approx({"a": 0.7, "b": 0.2}, abs=1e-4)
    # two slates with no node in common: the system is rank deficient without the ridge; stays finite
    apart = single + [Observation("t", "c", 0.9), Observation("t", "d", 0.9)]
    fit = fit_latent_scores(apart)
    assert all(np.isfinite(v) for v in fit.node_scores.values())
    assert fit.node_scores["c"] == pytest.approx(0.9, abs=1e-2)
    with pytest.raises(ValueError, match="bias_ridge"):
        fit_latent_scores(single, bias_ridge=0.0)
