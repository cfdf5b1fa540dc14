"""The async window's arithmetic, by hand (async_level k = 2)."""

from prime_hpc.rundir import window


def test_step_n_uses_policies_from_n_minus_k():
    assert window.oldest_usable(10, 2) == 8
    assert not window.is_stale(8, 10, 2) and window.is_stale(7, 10, 2)
    assert not window.is_stale(1, 2, 1) and window.is_stale(0, 2, 1)  # on-policy: step 2 needs policy 1


def test_a_rollout_started_under_policy_p_trains_up_to_step_p_plus_k():
    assert window.last_trainable(5, 2) == 7
    assert not window.is_stale(5, window.last_trainable(5, 2), 2)
    assert window.is_stale(5, window.last_trainable(5, 2) + 1, 2)


def test_weights_are_pruned_only_beyond_the_window_plus_one_step():
    # after writing step 10 with k = 2: step 10 may use 8, 9, 10; 7 is kept as margin
    assert [p for p in range(11) if window.prunable(p, 10, 2)] == [0, 1, 2, 3, 4, 5, 6]
    assert not any(window.prunable(p, 2, 1) for p in range(3))  # nothing old enough yet
