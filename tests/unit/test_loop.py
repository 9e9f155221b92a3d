"""Pure rules of the training loop."""

import pytest


def test_loss_spike_rule_needs_a_ratio_and_an_absolute_jump():
    from trainpipe.train.recovery import is_loss_spike

    hist = [1.0] * 10
    assert is_loss_spike(3.5, hist, 3.0, 0.1) == 1.0  # 3.5x and +2.5: a spike
    assert is_loss_spike(2.5, hist, 3.0, 0.1) is None  # below the ratio
    near_zero = [0.01] * 10  # a converged preference loss
    assert is_loss_spike(0.04, near_zero, 3.0, 0.1) is None  # 4x but +0.03: noise
    assert is_loss_spike(0.5, near_zero, 3.0, 0.1) == 0.01
    assert is_loss_spike(100.0, hist[:3], 3.0, 0.1) == 1.0  # issue 15.5: the history that exists (3 steps at least) is used
    assert is_loss_spike(100.0, hist[:2], 3.0, 0.1) is None  # fewer than 3 steps: no median yet
    assert is_loss_spike(100.0, hist, 0.0, 0.1) is None  # factor 0: off


def test_preference_losses_are_judged_against_their_own_scale_not_3x_a_median_near_zero():
    """A converging DPO run (pair losses 0.693 -> ~0.03, as examples/methods/dpo.yaml logs step by step) with one hard batch
    at 0.45 is not a spike once the objective's floor (ln 2, the zero-margin loss) is the reference; under the plain
    median rule it was (15 x the median, +0.42), and the run was rolled back, then stopped. A diverging batch still is."""
    import math

    from trainpipe.config import PreferenceConfig
    from trainpipe.train.objectives import TokenCrossEntropy
    from trainpipe.train.recovery import is_loss_spike
    from trainpipe.train.preference import KTOObjective, PairObjective
    from trainpipe.train.reward import BradleyTerry

    dpo_steps = [0.084, 0.059, 0.05, 0.088, 0.039, 0.052, 0.117, 0.078, 0.051, 0.049, 0.032, 0.041, 0.014, 0.021, 0.027, 0.015]
    pref = PreferenceConfig()
    floor = PairObjective("dpo", pref, None, 0).spike_floor
    assert floor == math.log(2)
    assert is_loss_spike(0.45, dpo_steps, 3.0, 0.1) is not None  # the SFT rule: a false alarm on a healthy DPO run
    assert is_loss_spike(0.45, dpo_steps, 3.0, 0.1, floor) is None
    assert is_loss_spike(1.9, dpo_steps, 3.0, 0.1, floor) is None  # a hard batch near 3 x ln 2: still DPO's own noise
    assert is_loss_spike(6.0, dpo_steps, 3.0, 0.1, floor) is not None  # log-sigmoid of large negative margins: divergence
    # each objective's floor is its loss at zero margin; token cross-entropy keeps the median rule
    assert PairObjective("dpo", PreferenceConfig(loss_type="hinge"), None, 0).spike_floor == 1.0
    assert PairObjective("dpo", PreferenceConfig(loss_type="ipo", beta=0.1), None, 0).spike_floor == pytest.approx(25.0)
    assert PairObjective("dpo", PreferenceConfig(loss_type="simpo", simpo_gamma=0.5), None, 0).spike_floor == pytest.approx(math.log1p(math.exp(0.5)))
    assert KTOObjective(PreferenceConfig(), None, 0).spike_floor == 0.5 and BradleyTerry(0).spike_floor == pytest.approx(math.log(2))
    assert TokenCrossEntropy(0).spike_floor == 0.0
