from scd.fitting.policy import choose_k, plan_layers


def test_policy_finds_the_sensitive_layers_and_stops_when_gains_flatten():
    # synthetic KL: layers 2 and 5 carry most error; patching removes 90% of a layer's share
    share = {1: 0.01, 2: 0.5, 3: 0.02, 4: 0.05, 5: 0.3, 6: 0.01}
    base = sum(share.values())
    res = plan_layers(list(share), kl_restored=lambda l: base - share[l],
                      kl_patched=lambda ls: base - 0.9 * sum(share[l] for l in ls),
                      base_kl=base, pool_size=3, cost=0.5)
    assert res.pool == [2, 4, 5], res.pool
    assert res.order[:2] == [2, 5], res.order
    assert res.chosen == [2, 5], f"k*={res.k_star}, efficiency={res.efficiency}"
    assert all(a >= b for a, b in zip(res.curve, res.curve[1:])), res.curve


def test_no_gain_means_no_patch():
    k, _ = choose_k([1.0, 1.0, 1.1], cost=0.1)
    assert k == 0


def test_the_policy_never_chooses_more_patches_than_the_payload_budget_allows():
    """Patching layers 2 and 5 would pay most, but a budget that fits one Patch code leaves the best single one."""
    share = {1: 0.01, 2: 0.5, 3: 0.02, 4: 0.05, 5: 0.3, 6: 0.01}
    base = sum(share.values())
    res = plan_layers(list(share), kl_restored=lambda l: base - share[l],
                      kl_patched=lambda ls: base - 0.9 * sum(share[l] for l in ls),
                      base_kl=base, pool_size=3, cost=0.5, fits=lambda ls: len(ls) <= 1)
    assert res.chosen == [2], f"k*={res.k_star}, efficiency={res.efficiency}"
