"""Pure rules of the training loop."""


def test_loss_spike_rule_needs_a_ratio_and_an_absolute_jump():
    from trainpipe.train.loop import is_loss_spike

    hist = [1.0] * 10
    assert is_loss_spike(3.5, hist, 3.0, 0.1) == 1.0  # 3.5x and +2.5: a spike
    assert is_loss_spike(2.5, hist, 3.0, 0.1) is None  # below the ratio
    near_zero = [0.01] * 10  # a converged preference loss
    assert is_loss_spike(0.04, near_zero, 3.0, 0.1) is None  # 4x but +0.03: noise
    assert is_loss_spike(0.5, near_zero, 3.0, 0.1) == 0.01
    assert is_loss_spike(100.0, hist[:3], 3.0, 0.1) == 1.0  # issue 15.5: the history that exists (3 steps at least) is used
    assert is_loss_spike(100.0, hist[:2], 3.0, 0.1) is None  # fewer than 3 steps: no median yet
    assert is_loss_spike(100.0, hist, 0.0, 0.1) is None  # factor 0: off
