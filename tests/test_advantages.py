"""Group advantages and the zero-variance mask on hand-computed examples."""

import math

import numpy as np
import pytest

from qerl_lib.advantages import group_advantages, group_stats, zero_variance_mask


def test_grpo_population_std_by_hand():
    # group a: rewards 1, 0, 0, 1 -> mean 0.5, population std 0.5 -> +-1
    # group b: rewards 1, 0, 0, 0 -> mean 0.25, population std sqrt(3)/4
    rewards = [1, 0, 0, 1, 1, 0, 0, 0]
    groups = ["a"] * 4 + ["b"] * 4
    adv = group_advantages(rewards, groups, scale=True, eps=0.0)
    sb = math.sqrt(3) / 4
    expected = [1, -1, -1, 1, 0.75 / sb, -0.25 / sb, -0.25 / sb, -0.25 / sb]
    np.testing.assert_allclose(adv, expected, rtol=1e-12)
    assert adv.shape == (8,) and adv.dtype == np.float64


def test_eps_is_added_to_std():
    adv = group_advantages([1.0, 0.0], [0, 0], scale=True, eps=0.5)
    # mean 0.5, population std 0.5 -> 0.5 / (0.5 + 0.5)
    np.testing.assert_allclose(adv, [0.5, -0.5])


def test_sample_std_matches_torch_std_convention():
    # ddof=1: group 1, 0, 0, 1 has sample std sqrt(1/3)
    adv = group_advantages([1, 0, 0, 1], [7, 7, 7, 7], eps=0.0, ddof=1)
    np.testing.assert_allclose(adv, np.array([0.5, -0.5, -0.5, 0.5]) / math.sqrt(1 / 3))


def test_dr_grpo_unscaled():
    adv = group_advantages([1.1, 0.1, 0.0, 3.0, 1.0], ["x", "x", "x", "y", "y"], scale=False)
    np.testing.assert_allclose(adv, [1.1 - 0.4, 0.1 - 0.4, -0.4, 1.0, -1.0])


def test_interleaved_groups_and_int_ids():
    adv = group_advantages([1, 5, 0, 3], [2, 9, 2, 9], scale=False)
    np.testing.assert_allclose(adv, [0.5, 1.0, -0.5, -1.0])


def test_equal_rewards_give_zero_advantage_and_mask():
    rewards = [1.1, 1.1, 1.1, 0.0, 0.1, 0.0]
    groups = ["p", "p", "p", "q", "q", "q"]
    adv = group_advantages(rewards, groups)
    np.testing.assert_allclose(adv[:3], 0.0)
    assert zero_variance_mask(rewards, groups).tolist() == [True, True, True, False, False, False]


def test_singleton_group():
    mean, std = group_stats([3.0, 1.0, 2.0], ["a", "b", "b"], ddof=1)
    np.testing.assert_allclose(std, [0.0, math.sqrt(0.5), math.sqrt(0.5)])
    assert group_advantages([3.0], ["a"], ddof=1).tolist() == [0.0]
    assert zero_variance_mask([3.0], ["a"]).tolist() == [True]


def test_bad_shapes_and_values():
    with pytest.raises(ValueError, match="shape"):
        group_advantages([1.0, 2.0], [0, 0, 0])
    with pytest.raises(ValueError, match="NaN"):
        group_advantages([1.0, float("nan")], [0, 0])
