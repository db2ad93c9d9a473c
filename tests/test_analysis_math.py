"""Properties shown by analysis/eq8_check.py (paper §3.3) and analysis/reward_decay.py (paper §3.1)."""
import pytest
import torch

from analysis import eq8_check, reward_decay

TOL = 1e-5


@pytest.fixture(scope="module")
def tiny_result():
    return eq8_check.run_check(n_tokens=2, horizon=4, eos=True, lambdas=(0.0, 0.5, 0.95, 1.0), seed=0)


def test_eq8_identity_gae_equals_n_step_return_form(tiny_result):
    assert tiny_result.eq8_max_err < TOL


def test_lambda_one_is_unbiased_for_every_critic(tiny_result):
    for name, by_lam in tiny_result.rel_bias.items():
        assert by_lam[1.0] < TOL, name


def test_exact_critic_is_unbiased_for_every_lambda(tiny_result):
    for lam, bias in tiny_result.rel_bias["V^pi (exact)"].items():
        assert bias < TOL, lam


def test_baseline_term_has_zero_expectation_for_every_critic(tiny_result):
    for name, rel in tiny_result.baseline_rel.items():
        assert rel < TOL, name


def test_wrong_critics_with_lambda_095_are_biased(tiny_result):
    for name in ("RM-like ramp", "random N(0,1)", "zero"):
        assert tiny_result.rel_bias[name][0.95] > 1e-3, name


def test_mdp_without_eos_has_fixed_length_and_same_properties():
    res = eq8_check.run_check(n_tokens=2, horizon=3, eos=False, lambdas=(0.5, 1.0), seed=1)
    assert res.n_responses == 8
    assert res.eq8_max_err < TOL and res.rel_bias["random N(0,1)"][1.0] < TOL
    assert res.rel_bias["RM-like ramp"][0.5] > 1e-3


def test_enumerated_probabilities_sum_to_one_and_root_value_is_expected_return():
    mdp = eq8_check.build_mdp(n_tokens=2, horizon=4, eos=True, seed=0)
    prob = eq8_check.token_log_probs(mdp).sum(1).exp().detach()
    assert abs(float(prob.sum()) - 1.0) < 1e-12
    v = eq8_check.exact_values(mdp)
    assert mdp.prefixes[0] == ()
    assert abs(float(v[0]) - float((prob * mdp.rewards.sum(1)).sum())) < 1e-12


def test_true_gradient_matches_finite_differences():
    mdp = eq8_check.build_mdp(n_tokens=2, horizon=3, eos=True, seed=2)
    g = eq8_check.true_gradient(mdp)

    def objective() -> float:
        with torch.no_grad():
            return float((eq8_check.token_log_probs(mdp).sum(1).exp() * mdp.rewards.sum(1)).sum())

    eps = 1e-6
    for i, j in [(0, 0), (0, 2), (3, 1)]:
        with torch.no_grad():
            mdp.logits[i, j] += eps
        up = objective()
        with torch.no_grad():
            mdp.logits[i, j] -= 2 * eps
        down = objective()
        with torch.no_grad():
            mdp.logits[i, j] += eps
        assert abs((up - down) / (2 * eps) - float(g[i, j])) < 1e-8


@pytest.mark.parametrize("kwargs", [
    dict(lambdas=(0.5, 1.5)), dict(lambdas=()), dict(horizon=0), dict(n_tokens=1, eos=False),
    dict(n_tokens=4, horizon=12),
])
def test_eq8_check_rejects_bad_settings_with_value_error(kwargs):
    with pytest.raises(ValueError):
        eq8_check.run_check(**kwargs)


def test_reward_decay_code_matches_formula():
    curves = reward_decay.decay_curves((0.9, 0.95, 0.99, 1.0), max_distance=1000)
    assert curves.code.shape == curves.formula.shape == (4, 1001)
    assert curves.max_abs_deviation() < 1e-6
    assert curves.max_rel_deviation() < 1e-4  # float32 rounding compounded over 1000 tokens
    assert (curves.code[-1] == 1.0).all()  # lambda = 1: every token sees the full reward
    assert abs(curves.code[1, 100] - 0.95**100) < 1e-7  # paper §3.1: 0.95^100 ~ 0.006


def test_reward_decay_rejects_bad_lambda_and_distance():
    with pytest.raises(ValueError):
        reward_decay.decay_curves((1.2,), 10)
    with pytest.raises(ValueError):
        reward_decay.decay_curves((0.9,), -1)
    with pytest.raises(ValueError):
        reward_decay.main(reward_decay.Args(max_distance=10, table_distances=(100,)))


def test_scripts_write_png_and_markdown(tmp_path):
    reward_decay.main(reward_decay.Args(out=tmp_path, max_distance=50, table_distances=(10, 50)))
    eq8_check.main(eq8_check.Args(out=tmp_path, horizon=3))
    for name in ("reward_decay", "eq8_check"):
        assert (tmp_path / f"{name}.png").stat().st_size > 1000
        assert "|" in (tmp_path / f"{name}.md").read_text()
    # The docstring's --max-distance 2000 alone: its table stops there (the default 5000 was refused).
    reward_decay.main(reward_decay.Args(out=tmp_path, lambdas=(0.9,), max_distance=2000))
    rows = [line.split(" |")[0] for line in (tmp_path / "reward_decay.md").read_text().splitlines()]
    listed = [r for r in rows if r in ("| 10", "| 100", "| 1000", "| 2000", "| 5000")]
    assert listed == ["| 10", "| 100", "| 1000", "| 2000"]


def test_a_response_cut_at_the_horizon_scores_minus_one_and_the_others_their_coin():
    """The MDP is the project's task in miniature: a response that reaches the horizon without EOS is
    cut and scores -1 (as an unboxed, truncated response does); one that ends with EOS gets its seeded
    +-1. The reward sits on each response's last token only."""
    mdp = eq8_check.build_mdp(n_tokens=2, horizon=3, eos=True, seed=0)
    eos_id = 2
    cut = [r for r in mdp.terminal_reward if r[-1] != eos_id]
    ended = [r for r in mdp.terminal_reward if r[-1] == eos_id]
    assert len(cut) == 2**3 and len(ended) == 1 + 2 + 4
    assert all(mdp.terminal_reward[r] == -1.0 for r in cut)
    assert {mdp.terminal_reward[r] for r in ended} == {-1.0, 1.0}
    lengths = mdp.mask.sum(1).long()
    assert torch.equal(mdp.rewards.abs().sum(1), torch.ones(len(lengths), dtype=torch.float64))
    assert (mdp.rewards[torch.arange(len(lengths)), lengths - 1] != 0).all()
    # without EOS every response has the full length and its coin decides
    no_eos = eq8_check.build_mdp(n_tokens=2, horizon=3, eos=False, seed=0)
    assert set(no_eos.terminal_reward.values()) == {-1.0, 1.0}


def test_relative_bias_is_the_gradient_error_over_the_true_gradients_norm():
    """rel_bias is ||g_GAE - g_true|| / ||g_true|| (the md and plot say so), recomputed here for the zero
    critic at lambda = 0, where A_t = r_t: only the last token's score is weighted, by the outcome."""
    res = eq8_check.run_check(n_tokens=2, horizon=3, eos=True, lambdas=(0.0, 1.0), seed=0)
    mdp = eq8_check.build_mdp(n_tokens=2, horizon=3, eos=True, seed=0)
    g_true = eq8_check.true_gradient(mdp)
    g_gae = eq8_check.expected_score_gradient(mdp, mdp.rewards)
    expected = float((g_gae - g_true).norm() / g_true.norm())
    assert expected > 0.1 and res.rel_bias["zero"][0.0] == pytest.approx(expected, rel=1e-5)


def test_eq8_report_gives_a_verdict_for_every_fact(tiny_result):
    """Facts 3 and 4 (lambda = 1, and V' = V^pi, unbiased) printed numbers with no verdict, unlike the
    identity and the baseline term; each fact now says whether it holds at the tolerance."""
    args = eq8_check.Args(n_tokens=2, horizon=4, lambdas=(0.0, 0.5, 0.95, 1.0))
    facts = [line for line in eq8_check.markdown(tiny_result, args, 0.0).splitlines() if line.startswith("- ")]
    assert len(facts) == 5
    assert "(unbiased at tolerance" in facts[2] and "(unbiased at tolerance" in facts[3]
    assert "(biased, every one at tolerance" in facts[4]
