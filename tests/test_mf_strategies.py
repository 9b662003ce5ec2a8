"""Strategy construction for DP matrix factorization (vmapdp.mf): workloads, sensitivity, expected
error, optimisation. Oracles: float64 dense linear algebra, brute force over all participation
patterns, torch.optim.SGD, scipy's matrix square root, a classical asymptotic (Landau's
constants), and the reference implementations in jax-privacy 2.0 and opake-dpftrl 0.16."""

import math

import pytest
import scipy.linalg
import torch

import vmapdp.mf as mf
from vmapdp.mf import BandedToeplitz, BufferedToeplitz

F64 = torch.float64


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    # small float64 problems: one thread is faster (much faster on a busy machine); results unchanged
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _lower_bound_signs(c, n, sep, k):
    """A lower bound on the true sensitivity: every pattern, scalar contributions g_t = +-1."""
    x = c.T @ c
    best = 0.0
    for pat in mf.participation_patterns(n, sep, k):
        idx = torch.tensor(pat)
        sub = x[idx][:, idx]
        for signs in range(1 << len(pat)):
            s = torch.tensor([1.0 if signs >> i & 1 else -1.0 for i in range(len(pat))], dtype=F64)
            best = max(best, float(s @ sub @ s))
    return math.sqrt(best)


# --- the Toeplitz algebra and the fixed strategies -------------------------------------------------


def test_toeplitz_product_and_inverse_match_dense_float64():
    g = torch.Generator().manual_seed(0)
    n = 40
    a = torch.randn(n, generator=g, dtype=F64)
    c = torch.rand(n, generator=g, dtype=F64) * 0.3 / torch.arange(1, n + 1)
    c[0] = 1.0
    ta, tc = mf.toeplitz_matrix(a, n), mf.toeplitz_matrix(c, n)
    torch.testing.assert_close(mf.toeplitz_matrix(mf.toeplitz_multiply(a, c, n), n), ta @ tc, rtol=0, atol=1e-13)
    torch.testing.assert_close(mf.toeplitz_matrix(mf.toeplitz_inverse(c, n), n), torch.linalg.inv(tc), rtol=0, atol=1e-13)
    # the Newton iteration at a length that is no power of two, against the triangular solve
    m = 1000
    c = mf.sqrt_prefix(m).toeplitz_coeffs(m)
    e0 = torch.zeros(m, 1, dtype=F64)
    e0[0] = 1
    want = torch.linalg.solve_triangular(mf.toeplitz_matrix(c, m), e0, upper=False)[:, 0]
    torch.testing.assert_close(mf.toeplitz_inverse(c, m), want, rtol=0, atol=1e-14)


def test_sqrt_prefix_is_the_matrix_square_root_of_prefix_sums():
    n = 30
    a = mf.prefix_sums(n)
    c = mf.sqrt_prefix(n).matrix(n)
    torch.testing.assert_close(c @ c, a, rtol=0, atol=1e-13)
    # independently: scipy's principal square root (Schur method) of the prefix-sum matrix
    root = torch.from_numpy(scipy.linalg.sqrtm(a.numpy()).real)
    torch.testing.assert_close(c, root, rtol=0, atol=1e-10)
    # binom(2k, k) / 4^k
    k = 7
    assert mf.sqrt_prefix(8).coeffs[k] == pytest.approx(math.comb(2 * k, k) / 4**k, rel=1e-15)
    assert mf.identity().matrix(5).equal(torch.eye(5, dtype=F64))


@pytest.mark.parametrize("n", [100, 1000])
def test_sqrt_prefix_error_is_the_square_of_landaus_constant(n):
    # For prefix sums and C = sqrt(A): A C^{-1} = C, so with one participation sens^2 = max row
    # error = G = sum_{k<n} (binom(2k,k)/4^k)^2, Landau's constant G_{n-1}. Watson (1930):
    # G_N = (ln(N+1) + gamma + 4 ln 2) / pi + O(1/N); here |O(1/N)| < 0.1/n.
    c = mf.sqrt_prefix(n).toeplitz_coeffs(n)
    g = float((c * c).sum())
    assert abs(g - (math.log(n) + 0.5772156649015329 + 4 * math.log(2)) / math.pi) < 0.1 / n
    assert mf.expected_error(mf.sqrt_prefix(n), None, n, max_participations=1, kind="max") == pytest.approx(g * g, rel=1e-12)


def test_identity_is_dpsgd_with_known_errors():
    n = 50
    # one participation: row t of A has t+1 ones, mean (n+1)/2, max n; k participations: sens^2 = k
    assert mf.expected_error(mf.identity(), None, n, max_participations=1) == pytest.approx((n + 1) / 2, rel=1e-13)
    assert mf.expected_error(mf.identity(), None, n, max_participations=1, kind="max") == pytest.approx(n, rel=1e-13)
    assert mf.expected_error(mf.identity(), None, n, min_separation=5) == pytest.approx(10 * (n + 1) / 2, rel=1e-13)
    assert mf.sensitivity(mf.identity(), n, min_separation=3, max_participations=4) == pytest.approx(2.0, rel=1e-15)


# --- workloads ---------------------------------------------------------------------------------


def test_momentum_workload_matches_torch_sgd():
    n, beta = 9, 0.8
    lrs = [0.5, 1.0, 2.0, 1.5, 1.0, 0.7, 0.3, 0.2, 0.1]
    a = mf.momentum_prefix_sums(n, beta, lrs)
    for s in range(n):  # column s: the parameter change when only step s has a gradient (of 1)
        p = torch.zeros(1, dtype=F64, requires_grad=True)
        opt = torch.optim.SGD([p], lr=lrs[0], momentum=beta)
        col = []
        for t in range(n):
            for group in opt.param_groups:
                group["lr"] = lrs[t]
            p.grad = torch.full((1,), 1.0 if t == s else 0.0, dtype=F64)
            opt.step()
            col.append(-float(p.detach()))
        torch.testing.assert_close(torch.tensor(col, dtype=F64), a[:, s], rtol=1e-14, atol=1e-14)
    assert mf.momentum_prefix_sums(n, 0.0).equal(mf.prefix_sums(n))
    assert mf.toeplitz_column(mf.momentum_prefix_sums(n, beta)) is not None  # constant lr: Toeplitz
    assert mf.toeplitz_column(a) is None


# --- sensitivity -------------------------------------------------------------------------------


def _random_strategies(n):
    g = torch.Generator().manual_seed(1)
    steps = torch.rand(5, generator=g, dtype=F64)
    mono = torch.cat([torch.ones(1, dtype=F64), torch.flip(torch.cumsum(steps, 0), [0])])  # >= 0, non-increasing from 1; c1 > c0 allowed
    th = torch.rand(3, generator=g, dtype=F64) * 0.95
    om = torch.rand(3, generator=g, dtype=F64) * 0.6
    return {
        "sqrt": mf.sqrt_prefix(n),
        "sqrt_band3": mf.sqrt_prefix(3),
        "nonneg_banded": BandedToeplitz(tuple(mono.tolist())),
        "blt": BufferedToeplitz(tuple(th.tolist()), tuple(om.tolist())),
        "identity": mf.identity(),
    }


def test_participation_patterns_are_all_admissible_sets():
    import itertools

    for n, sep, k in ((7, 1, None), (9, 2, 3), (8, 3, None), (6, 7, None)):
        cap = k or n
        want = {p for r in range(1, cap + 1) for p in itertools.combinations(range(n), r) if all(b - a >= sep for a, b in zip(p, p[1:]))}
        got = list(mf.participation_patterns(n, sep, k))
        assert len(got) == len(set(got)) and set(got) == want


@pytest.mark.parametrize("n,sep,k", [(10, 1, None), (10, 2, 3), (11, 3, None), (9, 4, 2), (12, 1, 4), (10, 1, 1), (8, 8, None)])
def test_sensitivity_equals_brute_force_over_all_patterns(n, sep, k):
    for name, strategy in _random_strategies(n).items():
        want = mf.brute_force_sensitivity(strategy, n, min_separation=sep, max_participations=k)
        got = mf.sensitivity(strategy, n, min_separation=sep, max_participations=k, require_exact=True)
        dense = mf.sensitivity(strategy.matrix(n), n, min_separation=sep, max_participations=k, require_exact=True)
        assert got == pytest.approx(want, rel=1e-12), name
        assert dense == pytest.approx(want, rel=1e-10), name


def test_signed_strategies_exact_where_columns_are_orthogonal_bounded_otherwise():
    n = 8
    signed = BandedToeplitz((1.0, -0.6, 0.35))
    # band <= min_separation: participations' columns are orthogonal, exact for any sign
    for k in (None, 2):
        got = mf.sensitivity(signed, n, min_separation=3, max_participations=k, require_exact=True)
        assert got == pytest.approx(_lower_bound_signs(signed.matrix(n), n, 3, k), rel=1e-12)
        assert got == pytest.approx(mf.brute_force_sensitivity(signed, n, min_separation=3, max_participations=k), rel=1e-12)
    # otherwise C^T C has negative entries: an upper bound, never below the truth, or a refusal
    g = torch.Generator().manual_seed(2)
    dense = torch.randn(n, n, generator=g, dtype=F64).tril() + 2 * torch.eye(n, dtype=F64)
    for strategy in (signed, dense):
        for sep, k in ((1, None), (2, 3)):
            bound = mf.sensitivity(strategy, n, min_separation=sep, max_participations=k)
            c = strategy if isinstance(strategy, torch.Tensor) else strategy.matrix(n)
            assert bound >= mf.brute_force_sensitivity(c, n, min_separation=sep, max_participations=k) * (1 - 1e-12)
            assert bound >= _lower_bound_signs(c, n, sep, k) * (1 - 1e-12)
            with pytest.raises(ValueError, match="upper bound"):
                mf.sensitivity(strategy, n, min_separation=sep, max_participations=k, require_exact=True)


def test_nonnegative_gram_without_structure_is_never_under_reported():
    # C^T C >= 0, so the brute force is the truth; the earliest pattern is not always the worst here
    n = 8
    g = torch.Generator().manual_seed(4)
    dense = torch.rand(n, n, generator=g, dtype=F64).tril() + torch.eye(n, dtype=F64)
    rising = BandedToeplitz((1.0, 0.1, 0.1, 0.9))  # coefficients rise again after index 1
    for strategy in (dense, rising):
        for sep, k in ((1, None), (2, 3), (1, 2)):
            truth = mf.brute_force_sensitivity(strategy, n, min_separation=sep, max_participations=k)
            got = mf.sensitivity(strategy, n, min_separation=sep, max_participations=k)
            assert got >= truth * (1 - 1e-12)
            try:
                exact = mf.sensitivity(strategy, n, min_separation=sep, max_participations=k, require_exact=True)
            except ValueError:
                continue
            assert exact == pytest.approx(truth, rel=1e-12)
    torch.testing.assert_close(mf.toeplitz_gram(rising.toeplitz_coeffs(n), n), rising.matrix(n).T @ rising.matrix(n), rtol=0, atol=1e-15)


def test_sensitivity_large_n_is_structured_and_matches_dense():
    n = 200
    blt = BufferedToeplitz((0.99, 0.8), (0.1, 0.3))
    for sep, k in ((1, None), (7, 20), (50, None)):
        assert mf.sensitivity(blt, n, min_separation=sep, max_participations=k) == pytest.approx(
            mf.sensitivity(blt.matrix(n), n, min_separation=sep, max_participations=k, require_exact=True), rel=1e-10
        )


# --- expected error ----------------------------------------------------------------------------


def test_expected_error_matches_dense_float64_oracle():
    n = 60
    workloads = [mf.prefix_sums(n), mf.momentum_prefix_sums(n, 0.9), mf.momentum_prefix_sums(n, 0.9, torch.linspace(1.0, 0.1, n))]
    for strategy in (mf.sqrt_prefix(8), BufferedToeplitz((0.95, 0.5), (0.2, 0.3))):
        c = strategy.matrix(n)
        for a in workloads:
            rows = ((a @ torch.linalg.inv(c)) ** 2).sum(1)
            s2 = mf.sensitivity(c, n, min_separation=5, require_exact=True) ** 2  # the dense path (rule 3 checked on C^T C)
            for kind, red in (("mean", rows.mean()), ("max", rows.max())):
                got = mf.expected_error(strategy, a, n, min_separation=5, kind=kind)
                assert got == pytest.approx(s2 * float(red), rel=1e-11)
                assert mf.expected_error(c, a, n, min_separation=5, kind=kind) == pytest.approx(got, rel=1e-11)


# --- BLT inverse -------------------------------------------------------------------------------


def test_blt_inverse_matches_dense_inverse_and_opake():
    from opake.api.dpftrl.noise import _blt_math

    n = 50
    blt = BufferedToeplitz((0.99, 0.9, 0.4), (0.05, 0.2, 0.3))
    inv = blt.inverse()
    torch.testing.assert_close(inv.matrix(n), torch.linalg.inv(blt.matrix(n)), rtol=0, atol=1e-12)
    assert all(w <= 0 for w in inv.omega)  # omega >= 0 gives a real inverse with omega <= 0
    # an inverse that grows (|theta| > 1): (1 + 2.5x) / (1 - 0.5x) inverts to 1 - 3x / (1 + 2.5x), theta -2.5, omega -3
    grow = BufferedToeplitz((0.5,), (3.0,)).inverse()
    torch.testing.assert_close(torch.tensor(grow.theta + grow.omega, dtype=F64), torch.tensor([-2.5, -3.0], dtype=F64), rtol=1e-12, atol=0)
    theirs = _blt_math.inverse(_blt_math.BufferedToeplitz(torch.tensor(blt.theta, dtype=F64), torch.tensor(blt.omega, dtype=F64)))
    order = torch.argsort(theirs.buf_decay, descending=True)
    mine = torch.argsort(torch.tensor(inv.theta), descending=True)
    torch.testing.assert_close(torch.tensor(inv.theta, dtype=F64)[mine], theirs.buf_decay[order], rtol=0, atol=1e-12)
    torch.testing.assert_close(torch.tensor(inv.omega, dtype=F64)[mine], theirs.output_scale[order], rtol=0, atol=1e-12)
    # a negative omega can make C^{-1} oscillate with complex theta: refused
    with pytest.raises(ValueError, match="complex"):
        BufferedToeplitz((0.9, 0.5), (0.3, -0.1)).inverse()
    assert BufferedToeplitz((), ()).inverse() == BufferedToeplitz((), ())


# --- optimisation ------------------------------------------------------------------------------


def test_optimal_banded_beats_identity_and_sqrt():
    n = 64
    # one participation, band = n: the mean-error optimum beats the square root (optimal for max error only)
    full = mf.optimal_banded(n, n, max_participations=1)
    e_full = mf.expected_error(full, None, n, max_participations=1)
    assert e_full < 0.97 * mf.expected_error(mf.sqrt_prefix(n), None, n, max_participations=1)
    assert math.isclose(math.fsum(x * x for x in full.coeffs), 1.0, rel_tol=1e-12)
    # min_separation = band (amplified banded MF): beats DP-SGD and the cut square root
    for band in (4, 16):
        opt = mf.optimal_banded(n, band)
        e = mf.expected_error(opt, None, n, min_separation=band)
        assert e < 0.5 * mf.expected_error(mf.identity(), None, n, min_separation=band)
        assert e < mf.expected_error(mf.sqrt_prefix(band), None, n, min_separation=band)
    # min_separation < band with several participations: kept in the exact class, still beats DP-SGD
    opt = mf.optimal_banded(n, 8, min_separation=2, max_participations=6, workload=mf.momentum_prefix_sums(n, 0.5))
    mf.sensitivity(opt, n, min_separation=2, max_participations=6, require_exact=True)
    e = mf.expected_error(opt, mf.momentum_prefix_sums(n, 0.5), n, min_separation=2, max_participations=6)
    assert e < mf.expected_error(mf.identity(), mf.momentum_prefix_sums(n, 0.5), n, min_separation=2, max_participations=6)


def test_optimisers_on_a_learning_rate_schedule_and_max_error():
    # momentum with a decaying learning rate: not Toeplitz, the O(n^2 log n) path
    n = 48
    a = mf.momentum_prefix_sums(n, 0.9, torch.linspace(1.0, 0.2, n))
    blt = mf.optimal_blt(n, 2, workload=a, max_participations=1)
    e = mf.expected_error(blt, a, n, max_participations=1)
    assert e < mf.expected_error(mf.sqrt_prefix(n), a, n, max_participations=1)
    assert e < 0.5 * mf.expected_error(mf.identity(), a, n, max_participations=1)
    assert e == pytest.approx(mf.expected_error(blt.matrix(n), a, n, max_participations=1), rel=1e-10)
    # max error, one participation: the band-n optimum is the square root (Dvijotham et al. 2024)
    full = mf.optimal_banded(n, n, max_participations=1, kind="max")
    sq = mf.expected_error(mf.sqrt_prefix(n), None, n, max_participations=1, kind="max")
    assert mf.expected_error(full, None, n, max_participations=1, kind="max") == pytest.approx(sq, rel=1e-9)


def test_optimal_banded_matches_jax_privacy_optimum():
    # jax-privacy 2.0 toeplitz.optimize_banded_toeplitz(100, bands) (single participation, mean),
    # run offline: loss 15.336178170715025 for 4 bands, 7.091412090672184 for 16; with
    # min_sep = 4 (100 % 4 == 0, the same objective) toeplitz.minsep_sensitivity_squared * mean
    # error = 383.4044542678755.
    n = 100
    assert mf.expected_error(mf.optimal_banded(n, 4, max_participations=1), None, n, max_participations=1) == pytest.approx(15.336178170715025, rel=1e-6)
    assert mf.expected_error(mf.optimal_banded(n, 16, max_participations=1), None, n, max_participations=1) == pytest.approx(7.091412090672184, rel=1e-6)
    assert mf.expected_error(mf.optimal_banded(n, 4), None, n, min_separation=4) == pytest.approx(383.4044542678755, rel=1e-6)


def test_optimal_blt_matches_jax_privacy_and_respects_theory():
    n = 100
    # jax-privacy 2.0 buffered_toeplitz.optimize(n=100, max_participations=1, error='mean',
    # min_buffers=2, max_buffers=2), run offline: LossFn.build_min_sep(...).loss = 5.386033560947438
    blt = mf.optimal_blt(n, 2, max_participations=1)
    e = mf.expected_error(blt, None, n, max_participations=1)
    assert e == pytest.approx(5.386033560947438, rel=1e-6)
    assert e < mf.expected_error(mf.sqrt_prefix(n), None, n, max_participations=1)
    assert all(0 < t < 1 for t in blt.theta) and all(w > 0 for w in blt.omega)
    # max error, one participation: the square root is optimal among Toeplitz strategies
    # (Dvijotham et al. 2024), so a BLT can approach but not beat it
    blt_max = mf.optimal_blt(n, 2, max_participations=1, kind="max")
    e_max = mf.expected_error(blt_max, None, n, max_participations=1, kind="max")
    sq = mf.expected_error(mf.sqrt_prefix(n), None, n, max_participations=1, kind="max")
    assert sq * (1 - 1e-9) <= e_max < 1.02 * sq
    # ten participations, 10 apart: jax-privacy 2.0 buffered_toeplitz.optimize(n=100, min_sep=10,
    # max_participations=None, error='mean', min_buffers=b, max_buffers=b), run offline, reaches
    # 97.88167696009386 for b = 2 (and b = 3, 4) with its thetas merging into one; ours merges them
    multi = mf.optimal_blt(n, 2, min_separation=10)
    e_multi = mf.expected_error(multi, None, n, min_separation=10)
    assert e_multi == pytest.approx(97.88167696009386, rel=1e-6) and multi.buffers == 1
    torch.testing.assert_close(multi.inverse().matrix(n), torch.linalg.inv(multi.matrix(n)), rtol=0, atol=1e-12)
    assert e_multi < 0.5 * mf.expected_error(mf.identity(), None, n, min_separation=10)
    assert e_multi < mf.expected_error(mf.sqrt_prefix(n), None, n, min_separation=10)


# --- cross-checks with the reference implementations ---------------------------------------------


def test_same_quantities_as_opake():
    from opake.api.dpftrl.noise import _sensitivity as osens
    from opake.api.dpftrl.noise import _toeplitz as otoe

    n = 60
    blt = BufferedToeplitz((0.97, 0.7), (0.15, 0.25))
    c = blt.toeplitz_coeffs(n)
    for sep, k in ((1, None), (4, 5), (1, 1)):
        want = float(otoe.minsep_sensitivity_squared(c, sep, k, n))
        assert mf.sensitivity(blt, n, min_separation=sep, max_participations=k) ** 2 == pytest.approx(want, rel=1e-12)
    assert mf.expected_error(blt, None, n, max_participations=1) == pytest.approx(float(otoe.mean_loss(c, n)), rel=1e-12)
    assert mf.expected_error(blt, None, n, max_participations=1, kind="max") == pytest.approx(float(otoe.max_loss(c, n)), rel=1e-12)
    # the dense upper bound (Algorithm 4) on a signed C; opake returns it in float32
    g = torch.Generator().manual_seed(3)
    dense = torch.randn(12, 12, generator=g, dtype=F64).tril() + 2 * torch.eye(12, dtype=F64)
    for sep, k in ((1, None), (3, 3)):
        want = float(osens.get_min_sep_sensitivity_upper_bound(dense, sep, k))
        assert mf.sensitivity(dense, 12, min_separation=sep, max_participations=k) == pytest.approx(want, rel=1e-6)


def test_same_quantities_as_jax_privacy():
    import jax  # a test extra (pyproject), like opake

    jax.config.update("jax_enable_x64", True)
    import jax.numpy as jnp
    import numpy as np
    from jax_privacy.matrix_factorization import toeplitz

    n = 100
    opt = mf.optimal_banded(n, 16, max_participations=1)
    coeffs = jnp.asarray(np.array(opt.coeffs))
    assert mf.expected_error(opt, None, n, max_participations=1) == pytest.approx(float(toeplitz.loss(coeffs, n)), rel=1e-9)
    sq = jnp.asarray(mf.sqrt_prefix(n).toeplitz_coeffs(n).numpy())
    assert mf.sensitivity(mf.sqrt_prefix(n), n, min_separation=3, max_participations=5) ** 2 == pytest.approx(
        float(toeplitz.minsep_sensitivity_squared(sq, 3, 5, n)), rel=1e-12
    )


# --- invalid arguments ----------------------------------------------------------------------------


def test_invalid_arguments_are_refused_with_the_fix():
    with pytest.raises(ValueError, match="min_separation=0 must be an int >= 1"):
        mf.sensitivity(mf.identity(), 10, min_separation=0)
    with pytest.raises(TypeError, match="max_participations"):
        mf.sensitivity(mf.identity(), 10, max_participations=2.0)
    with pytest.raises(ValueError, match="lower-triangular"):
        mf.sensitivity(torch.ones(4, 4, dtype=F64), 4)
    with pytest.raises(ValueError, match="4 x 4"):
        mf.expected_error(torch.eye(3, dtype=F64), None, 4)
    with pytest.raises(TypeError, match="strategy"):
        mf.sensitivity([1.0, 0.5], 4)
    with pytest.raises(ValueError, match="kind"):
        mf.expected_error(mf.identity(), None, 4, kind="MEAN")
    with pytest.raises(ValueError, match="workload"):
        mf.expected_error(mf.identity(), mf.prefix_sums(5), 4)
    with pytest.raises(ValueError, match="momentum"):
        mf.momentum_prefix_sums(4, 1.0)
    with pytest.raises(ValueError, match="learning_rates"):
        mf.momentum_prefix_sums(4, 0.9, [1.0, 2.0])
    with pytest.raises(ValueError, match="band=20 must be <= n=10"):
        mf.optimal_banded(10, 20)
    with pytest.raises(ValueError, match="buffers"):
        mf.optimal_blt(10, -1)
    with pytest.raises(ValueError, match="band"):
        mf.sqrt_prefix(0)
    with pytest.raises(ValueError, match="patterns"):
        list(mf.participation_patterns(60, 1))
    with pytest.raises(ValueError, match="singular"):
        mf.toeplitz_inverse(torch.tensor([0.0, 1.0], dtype=F64), 2)
