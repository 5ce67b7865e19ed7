"""Unit tests of workers/projection.py: the seeded, block-generated JL projection.

Covers: R does not depend on the block size that generated it; seeds and groups give different
matrices; entry distributions (Rademacher exactly ±1/sqrt(k), Gaussian N(0, 1/k)); the JL
guarantee on inner products and cosines of 1,000 rows; blocked projection == whole projection ==
rows @ R; groups; CPU == CUDA when a GPU is present; the hash against a pure-Python reference
of the definition in the module docstring (counters near and past 2^31, seeds past 2^63);
input validation and the registry.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from classgrad.errors import ConfigError, InputError
from classgrad.workers.projection import (
    HASH_NAME,
    PROJECTIONS,
    ProjectionKind,
    Projector,
    create_projection,
    mix32,
    register_projection,
    stream_keys,
    stream_words,
)
from tests.support.devices import needs_cuda

KINDS = ["rademacher", "gaussian"]
U32 = 2.0**-24  # float32 unit roundoff


# ---------------------------------------------------------------------------------------------
# Pure-Python reference of the generator, written from the module docstring's definition with
# Python ints (explicit masking) and numpy float32 scalars (each operation rounded once).

M = 0xFFFFFFFF


def ref_mix32(x: int) -> int:
    x &= M
    x ^= x >> 16
    x = (x * 0x21F0AAAD) & M
    x ^= x >> 15
    x = (x * 0x735A2D97) & M
    x ^= x >> 15
    return x


def ref_keys(seed: int, group: int) -> tuple[int, int]:
    s = 0x636C6772
    for w in (seed & M, seed >> 32, group):
        s = ref_mix32(s ^ w)
    return ref_mix32(s ^ 0x52), ref_mix32(s ^ 0x43)


def ref_word(keys: tuple[int, int], r: int, j: int) -> int:
    a = ref_mix32(r ^ keys[0])
    b = ref_mix32(ref_mix32(j ^ keys[1]))
    return ref_mix32(a ^ b)


F = np.float32


def _horner(z: np.float32, coeffs: list[float]) -> np.float32:
    acc = F(coeffs[-1])
    for c in reversed(coeffs[:-1]):
        acc = F(acc * z)
        acc = F(acc + F(c))
    return acc


def ref_row(kind: str, seed: int, group: int, r: int, k: int) -> np.ndarray:
    keys = ref_keys(seed, group)
    s = F(1.0 / math.sqrt(k))
    if kind == "rademacher":
        words = [ref_word(keys, r, j) for j in range(-(-k // 32))]
        return np.array([s if (words[c // 32] >> (c % 32)) & 1 == 0 else -s for c in range(k)], F)
    pairs = -(-k // 2)
    out = np.empty(2 * pairs, F)
    log_c = [1 / (2 * i + 1) for i in range(6)]
    cos_c = [(-1) ** i / math.factorial(2 * i) for i in range(7)]
    sin_c = [(-1) ** i / math.factorial(2 * i + 1) for i in range(6)]
    for i in range(pairs):
        h1, h2 = ref_word(keys, r, i), ref_word(keys, r, pairs + i)
        n = (h1 >> 8) | 1
        e = n.bit_length() - 1
        m = F(n / 2**e)
        t = F(F(m - F(1)) / F(m + F(1)))
        t2 = F(t * t)
        log_m = F(F(_horner(t2, log_c) * t) * F(2))
        log_u = F(F(F(e - 24) * F(math.log(2))) + log_m)
        v = max(F(log_u * F(-2)), F(2.0**-100))
        y = np.array((int(np.array(v).view(np.int32)) >> 1) + 0x1FBD1DF5, np.int32).view(F)[()]
        for _ in range(3):
            y = F(F(F(v / y) + y) * F(0.5))
        rs = F(y * s)
        step = F(F(math.pi / 2) * F(2.0**-21))
        x = F(F(F(h2 >> 10) - F(2**21 - 0.5)) * step)
        x2 = F(x * x)
        sin_x = F(_horner(x2, sin_c) * x)
        cos_x = _horner(x2, cos_c)
        sign = F(1) if h1 & 1 == 0 else F(-1)
        out[2 * i + 1] = F(rs * sin_x)
        out[2 * i] = F(F(rs * sign) * cos_x)
    return out[:k]


# ---------------------------------------------------------------------------------------------
# Helpers.


def _jl_eps(k: int, n_pairs: int, delta: float) -> float:
    """Smallest eps with n_pairs * 4 exp(-k (eps^2/2 - eps^3/3) / 2) <= delta.

    For R with i.i.d. entries ±1/sqrt(k) or N(0, 1/k) and any z, P(| |Rz|^2 - |z|^2 | >
    eps |z|^2) <= 2 exp(-k (eps^2/2 - eps^3/3) / 2) (Achlioptas 2003; Dasgupta–Gupta for the
    Gaussian case). Applying it to x + y and x - y of unit x, y (polarization: <Rx, Ry> =
    (|R(x+y)|^2 - |R(x-y)|^2) / 4) gives |<Rx, Ry> - <x, y>| <= eps except with probability
    4 exp(...); a union bound over all pairs makes every pair hold with probability 1 - delta.
    """
    lo, hi = 1e-6, 0.6  # the bound decreases in eps on this range
    for _ in range(100):
        mid = (lo + hi) / 2
        if n_pairs * 4 * math.exp(-k * (mid**2 / 2 - mid**3 / 3) / 2) > delta:
            lo = mid
        else:
            hi = mid
    return hi


def _full_matrix(p: Projector, group: int = 0) -> torch.Tensor:
    return p.matrix_block(group, 0, p.groups[group][1])


def _gamma(n: int) -> float:
    """Higham's gamma_n = n u / (1 - n u): any float32 inner product of length n, summed in any
    order (FMA or not), is within gamma_n * sum |x_i y_i| of the exact value."""
    return n * U32 / (1 - n * U32)


# ---------------------------------------------------------------------------------------------
# Determinism.


@pytest.mark.parametrize("kind", KINDS)
def test_matrix_does_not_depend_on_block_size(kind: str) -> None:
    p = Projector(3000, 100, kind=kind, seed=7)
    whole = p.matrix_block(0, 0, 3000)
    for stop, step in ((100, 1), (1000, 37), (3000, 1024)):
        pieces = torch.cat([p.matrix_block(0, a, min(stop, a + step)) for a in range(0, stop, step)])
        assert torch.equal(whole[:stop], pieces)
    assert torch.equal(whole[1234:2345], p.matrix_block(0, 1234, 2345))
    # The block size project() uses does not change the result beyond float summation order:
    # each output is a length-3000 float32 sum, so two orders differ by at most
    # 2 * gamma_3000 * (|x| @ |R|) (see _gamma).
    x = torch.randn(5, 3000, generator=torch.Generator().manual_seed(0))
    bound = 2 * _gamma(3000) * (x.abs() @ whole.abs())
    ref = Projector(3000, 100, kind=kind, seed=7, block_rows=3000).project(x)
    for block_rows in (64, 999):
        got = Projector(3000, 100, kind=kind, seed=7, block_rows=block_rows).project(x)
        assert torch.all((got - ref).abs() <= bound)
    # The same projector gives the same matrix every time.
    assert torch.equal(whole, Projector(3000, 100, kind=kind, seed=7).matrix_block(0, 0, 3000))


@pytest.mark.parametrize("kind", KINDS)
def test_seeds_and_groups_give_different_matrices(kind: str) -> None:
    k, rows = 64, 512
    mats = {
        "seed0": Projector(rows, k, kind=kind, seed=0).matrix_block(0, 0, rows),
        "seed1": Projector(rows, k, kind=kind, seed=1).matrix_block(0, 0, rows),
        "seed2^32": Projector(rows, k, kind=kind, seed=2**32).matrix_block(0, 0, rows),
        "group1": Projector(2 * rows, k, kind=kind, seed=0, groups=[(0, rows), (rows, rows)]).matrix_block(1, 0, rows),
    }
    names = list(mats)
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            # Independent matrices: the normalized inner product of their flattened entries has
            # standard deviation 1/sqrt(n) (n = 32768 entries); 6/sqrt(n) = 0.033 is reached by
            # chance with probability 2e-9, while a seed or group that is ignored gives 1.
            va, vb = mats[a].flatten().double(), mats[b].flatten().double()
            corr = (va @ vb / (va.norm() * vb.norm())).item()
            assert abs(corr) < 6 / math.sqrt(va.numel()), (a, b, corr)
    # Rows of one matrix are also uncorrelated with the next row (no row-to-row structure).
    m = mats["seed0"].double() * math.sqrt(k)
    lag = (m[:-1] * m[1:]).mean().item()
    # mean of (rows - 1) * k products of independent unit-variance entries: sd 1/sqrt(n).
    assert abs(lag) < 6 / math.sqrt((rows - 1) * k)


# ---------------------------------------------------------------------------------------------
# Distributions.


def test_rademacher_entries() -> None:
    k, rows = 256, 4096
    R = Projector(rows, k, kind="rademacher", seed=3).matrix_block(0, 0, rows)
    s = torch.tensor(1 / math.sqrt(k), dtype=torch.float32)
    assert R.dtype == torch.float32 and R.shape == (rows, k)
    assert torch.all((R == s) | (R == -s)), "entries must be exactly ±float32(1/sqrt(k))"
    signs = (R / s).double()
    n = signs.numel()
    # Mean of n independent ±1: standard error 1/sqrt(n); 5 SE is exceeded with prob 6e-7.
    assert abs(signs.mean().item()) < 5 / math.sqrt(n)
    # Every bit position of the 32-bit words (column c uses bit c % 32) is balanced: 32 means of
    # n/32 signs each, SE sqrt(32/n); 5.5 SE keeps the chance of any false alarm below 1e-6.
    per_bit = signs.view(rows, k // 32, 32).mean(dim=(0, 1))
    assert per_bit.abs().max().item() < 5.5 * math.sqrt(32 / n)
    # Neighbouring columns (also across byte and word boundaries) are uncorrelated: the mean of
    # rows * (k - 1) products of independent signs has SE 1/sqrt(rows * (k - 1)).
    adj = (signs[:, 1:] * signs[:, :-1]).mean().item()
    assert abs(adj) < 5 / math.sqrt(rows * (k - 1))


def _normal_cdf(z: torch.Tensor) -> torch.Tensor:
    return 0.5 * torch.erfc(-z / math.sqrt(2))


def test_gaussian_entries() -> None:
    k, rows = 256, 4096
    R = Projector(rows, k, kind="gaussian", seed=5).matrix_block(0, 0, rows)
    z = (R.double() * math.sqrt(k)).flatten()  # should be N(0, 1)
    n = z.numel()
    # Mean: SE 1/sqrt(n). Variance: the sample variance of n normals has SE sqrt(2/n).
    # Kurtosis (E z^4 = 3): SE sqrt(96/n) (Var z^4 = 105 - 9). All at 5 SE (false alarm < 1e-6).
    assert abs(z.mean().item()) < 5 / math.sqrt(n)
    assert abs(z.var().item() - 1) < 5 * math.sqrt(2 / n)
    assert abs((z**4).mean().item() - 3) < 5 * math.sqrt(96 / n)
    # Kolmogorov–Smirnov against N(0, 1): P(sqrt(n) D > t) ~ 2 exp(-2 t^2), so t = 2.2 gives a
    # false alarm rate of 1e-4. The generator's discreteness (24- and 22-bit uniforms) and its
    # truncation at 5.77 sd move the CDF by < 1e-6, far below 2.2/sqrt(n) = 2e-3.
    zs, _ = torch.sort(z)
    cdf = _normal_cdf(zs)
    i = torch.arange(1, n + 1, dtype=torch.float64)
    ks = torch.maximum(i / n - cdf, cdf - (i - 1) / n).max().item()
    assert ks < 2.2 / math.sqrt(n)
    # The two entries of a Box–Muller pair are independent: their product has mean 0 (SE
    # 1/sqrt(pairs)) and their squares are uncorrelated, E[z0^2 z1^2] = 1 with
    # Var(z0^2 z1^2) = E z0^4 E z1^4 - 1 = 8, so SE sqrt(8/pairs). A shared or wrong radius
    # would correlate the squares.
    pairs = R.double().mul(math.sqrt(k)).view(rows, k // 2, 2)
    z0, z1 = pairs[..., 0].flatten(), pairs[..., 1].flatten()
    m = z0.numel()
    assert abs((z0 * z1).mean().item()) < 5 / math.sqrt(m)
    assert abs((z0**2 * z1**2).mean().item() - 1) < 5 * math.sqrt(8 / m)
    # Cosine and sine entries each have unit variance (a wrong quadrant mapping breaks this);
    # SE of each sample variance sqrt(2/m).
    assert abs(z0.var().item() - 1) < 5 * math.sqrt(2 / m)
    assert abs(z1.var().item() - 1) < 5 * math.sqrt(2 / m)


# ---------------------------------------------------------------------------------------------
# The JL guarantee.


def _clustered_rows(n: int, d: int, seed: int) -> torch.Tensor:
    """Rows with cosines spread over [~0, 1) (20 clusters, varying cluster weight) and norms
    over four orders of magnitude, like per-class gradients of related classes."""
    g = torch.Generator().manual_seed(seed)
    centers = torch.randn(20, d, generator=g, dtype=torch.float64)
    which = torch.randint(0, 20, (n,), generator=g)
    weight = torch.rand(n, 1, generator=g, dtype=torch.float64) * 3
    x = centers[which] * weight + torch.randn(n, d, generator=g, dtype=torch.float64)
    x = x * 10 ** (torch.rand(n, 1, generator=g, dtype=torch.float64) * 4 - 2)
    return x.float()


@pytest.mark.parametrize("kind", KINDS)
def test_jl_inner_products_and_cosines(kind: str) -> None:
    n, d, k = 1000, 4096, 1024
    x = _clustered_rows(n, d, seed=1)
    p = Projector(d, k, kind=kind, seed=11)
    y = p.project(x).double()
    xd = x.double()
    gram, gram_p = xd @ xd.T, y @ y.T
    norm = gram.diag().sqrt()
    iu = torch.triu_indices(n, n)  # all pairs i <= j, norms (i == j) included
    n_pairs = iu.shape[1]
    err = ((gram_p - gram) / (norm[:, None] * norm[None, :]))[iu[0], iu[1]]

    # 1. Worst case, from the JL lemma: with delta = 0.01 over all 500,500 pairs, eps = 0.307
    # for k = 1024 (see _jl_eps); every normalized inner-product error must be below it.
    eps = _jl_eps(k, n_pairs, delta=0.01)
    assert 0.30 < eps < 0.31
    assert err.abs().max().item() <= eps

    # On that event |<Rx^, Ry^> - cos| <= eps and |Rx^| |Ry^| lies in [1 - eps, 1 + eps] for the
    # unit rows x^, y^, so |cos' - cos| <= eps (1 + |cos|) / (1 - eps).
    cos = (gram / (norm[:, None] * norm[None, :]))[iu[0], iu[1]]
    norm_p = gram_p.diag().sqrt()
    cos_p = (gram_p / (norm_p[:, None] * norm_p[None, :]))[iu[0], iu[1]]
    assert torch.all((cos_p - cos).abs() <= eps * (1 + cos.abs()) / (1 - eps))

    # 2. Sharper: the errors have the variance theory predicts. For fixed x, y,
    # Var <Rx, Ry> = (|x|^2 |y|^2 + <x,y>^2 - c * sum_i x_i^2 y_i^2) / k with c = 2 for
    # Rademacher and c = 0 for Gaussian entries; the mean of err^2 / var over all pairs is 1 in
    # expectation. Its spread comes from the one shared R (the pairs are dependent): measured
    # over 10 seeds its sd is 0.04 (rademacher) / 0.025 (gaussian) on these rows, so +-0.2 is 5 sd
    # of the worse one. A matrix with the wrong scale, correlated columns or too few independent
    # signs (e.g. a weak hash) moves it far outside.
    sq = xd**2
    c = 2.0 if kind == "rademacher" else 0.0
    var = (gram.diag()[:, None] * gram.diag()[None, :] + gram**2 - c * (sq @ sq.T)) / k
    z2 = ((gram_p - gram) ** 2 / var)[iu[0], iu[1]]
    assert abs(z2.mean().item() - 1) < 0.2

    # Cosines: to first order (delta method) Var cos' = (1 - cos^2)^2 / k; the mean squared
    # error over the off-diagonal pairs divided by its predicted mean is 1 with a measured sd of
    # 0.034 over 10 seeds, so +-0.2 is about 6 sd.
    off = iu[0] != iu[1]
    ratio = ((cos_p - cos)[off] ** 2).mean() / ((1 - cos[off] ** 2) ** 2 / k).mean()
    assert abs(ratio.item() - 1) < 0.2


# ---------------------------------------------------------------------------------------------
# Blocked == whole == rows @ R.


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("k", [1, 7, 33, 64])
def test_project_equals_rows_times_full_matrix(kind: str, k: int) -> None:
    d = 1500
    p = Projector(d, k, kind=kind, seed=2, block_rows=256)
    R = _full_matrix(p)
    assert R.shape == (d, k)
    x = torch.randn(9, d, generator=torch.Generator().manual_seed(k))
    got = p.project(x)
    assert got.shape == (9, k) and got.dtype == torch.float32
    exact = x.double() @ R.double()  # float64: its own error (~1e-13 relative) is negligible
    # One float32 sum of d products, in whatever order the blocks and BLAS choose: within
    # gamma_d * (|x| @ |R|) of the exact value (Higham, Thm 3.1).
    bound = _gamma(d) * (x.abs().double() @ R.abs().double())
    assert torch.all((got.double() - exact).abs() <= bound)


@pytest.mark.parametrize("kind", KINDS)
def test_projecting_row_blocks_equals_projecting_all(kind: str) -> None:
    d, k = 2000, 48
    p = Projector(d, k, kind=kind, seed=4, block_rows=300)
    x = torch.randn(100, d, generator=torch.Generator().manual_seed(1))
    whole = p.project(x)
    parts = torch.cat([p.project(x[a : a + 13]) for a in range(0, 100, 13)])
    # BLAS may pick another summation order for another batch size: two float32 sums of d
    # products differ by at most 2 * gamma_d * (|x| @ |R|).
    bound = 2 * _gamma(d) * (x.abs() @ _full_matrix(p).abs())
    assert torch.all((whole - parts).abs() <= bound)
    # One row alone, a float64 row and an empty batch.
    assert torch.all((p.project(x[5:6]) - whole[5:6]).abs() <= bound[5:6])
    assert torch.all((p.project(x.double()) - whole).abs() <= bound)
    assert p.project(x[:0]).shape == (0, k)


@pytest.mark.parametrize("kind", KINDS)
def test_groups_concatenate_per_group_projections(kind: str) -> None:
    d, k = 1000, 16
    groups = [(600, 400), (0, 100), (150, 250)]  # any order; columns 100-149 and 400-599 unused
    p = Projector(d, k, kind=kind, seed=9, groups=groups, block_rows=64)
    assert p.out_dim == 3 * k
    x = torch.randn(6, d, generator=torch.Generator().manual_seed(2))
    got = p.project(x)
    assert got.shape == (6, 3 * k)
    for g, (offset, size) in enumerate(groups):
        R = p.matrix_block(g, 0, size)
        xs = x[:, offset : offset + size]
        bound = _gamma(size) * (xs.abs().double() @ R.abs().double())
        assert torch.all((got[:, g * k : (g + 1) * k].double() - xs.double() @ R.double()).abs() <= bound)
    # Group g's stream is (seed, g): group 0 is the same matrix as an ungrouped projector's.
    alone = Projector(400, k, kind=kind, seed=9)
    assert torch.equal(p.matrix_block(0, 0, 400), alone.matrix_block(0, 0, 400))
    # Columns outside every group do not matter.
    x2 = x.clone()
    x2[:, 100:150] = 1e6
    x2[:, 400:600] = -1e6
    assert torch.equal(p.project(x2), got)
    # groups=None is one group over the whole row.
    assert torch.equal(
        Projector(d, k, kind=kind, seed=9, groups=[(0, d)]).project(x), Projector(d, k, kind=kind, seed=9).project(x)
    )


# ---------------------------------------------------------------------------------------------
# Devices.


@needs_cuda
@pytest.mark.parametrize("kind", KINDS)
def test_cuda_matches_cpu(kind: str) -> None:
    # Entries are computed with exact integer ops and single IEEE float32 operations, so the
    # blocks must be bit-identical, including near the 2^32 row limit.
    p = Projector(2**32 - 1, 257, kind=kind, seed=2**63 + 1)
    for start, stop in [(0, 4096), (2**31 - 100, 2**31 + 100), (2**32 - 300, 2**32 - 1)]:
        cpu = p.matrix_block(0, start, stop, "cpu")
        gpu = p.matrix_block(0, start, stop, "cuda")
        assert torch.equal(cpu, gpu.cpu()), (start, stop)
    # Projections agree up to summation order: within 2 * gamma_d * (|x| @ |R|). TF32 would
    # break this bound, so it is switched off here (it is off by default).
    d, k = 20_000, 512
    q = Projector(d, k, kind=kind, seed=3)
    x = torch.randn(64, d, generator=torch.Generator().manual_seed(0))
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        got = q.project(x.cuda())
    finally:
        torch.backends.cuda.matmul.allow_tf32 = previous
    assert got.device.type == "cuda"
    ref = q.project(x)
    bound = 2 * _gamma(d) * (x.abs() @ _full_matrix(q).abs())
    assert torch.all((got.cpu() - ref).abs() <= bound)


# ---------------------------------------------------------------------------------------------
# The hash: overflow safety and agreement with the reference definition.


def test_hash_matches_python_reference_for_large_counters() -> None:
    values = [0, 1, 2**16 - 1, 2**16, 2**31 - 1, 2**31, 2**31 + 1, 2**32 - 2, 2**32 - 1]
    values += [(0x9E3779B9 * i) & M for i in range(1, 200)]
    got = mix32(torch.tensor(values, dtype=torch.int64))
    assert got.tolist() == [ref_mix32(v) for v in values]
    assert int(got.min()) >= 0 and int(got.max()) <= M

    for seed, group in [(0, 0), (123, 5), (2**32 + 7, 2**31), (2**63 + 5, 2**32 - 1), (2**64 - 1, 1)]:
        assert stream_keys(seed, group) == ref_keys(seed, group)
        keys = stream_keys(seed, group)
        for start in (0, 2**31 - 3, 2**32 - 5):
            words = stream_words(keys, start, start + 5, 40, "cpu")
            expect = [[ref_word(keys, r, j) for j in range(40)] for r in range(start, start + 5)]
            assert words.tolist() == expect


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("k", [64, 37])
def test_entries_match_python_reference(kind: str, k: int) -> None:
    # The largest group the counters allow (2^32 - 1 rows); nothing is allocated until asked.
    seed = 2**63 + 12345
    p = Projector(2**32 - 1 + 10, k, kind=kind, seed=seed, groups=[(0, 10), (10, 2**32 - 1)])
    # A block of 64 rows runs the vectorized kernels' bodies as well as their scalar tails.
    blocks = [(0, 0, 3), (1, 0, 64), (1, 2**31 - 1, 2**31 + 1), (1, 2**32 - 3, 2**32 - 1)]
    for group, start, stop in blocks:
        got = p.matrix_block(group, start, stop).numpy()
        expect = np.stack([ref_row(kind, seed, group, r, k) for r in range(start, stop)])
        # Bit-identical: the reference repeats every float32 rounding of the definition.
        assert np.array_equal(got.view(np.int32), expect.view(np.int32)), (group, start)


# ---------------------------------------------------------------------------------------------
# Validation, describe, registry.


def test_invalid_arguments_raise_clear_errors() -> None:
    with pytest.raises(ConfigError, match="dim"):
        Projector(100, 0)
    with pytest.raises(ConfigError, match="dim_in"):
        Projector(0, 10)
    with pytest.raises(ConfigError, match=r"unknown \(choices: gaussian, rademacher\)"):
        Projector(100, 10, kind="sparse")
    with pytest.raises(ConfigError, match="seed"):
        Projector(100, 10, seed=-1)
    with pytest.raises(ConfigError, match="seed"):
        Projector(100, 10, seed=2**64)
    with pytest.raises(ConfigError, match="block_rows"):
        Projector(100, 10, block_rows=0)
    with pytest.raises(ConfigError, match="overlap"):
        Projector(100, 10, groups=[(0, 50), (40, 20)])
    with pytest.raises(ConfigError, match="past the row width"):
        Projector(100, 10, groups=[(90, 20)])
    with pytest.raises(ConfigError, match="size"):
        Projector(100, 10, groups=[(0, 0)])
    with pytest.raises(ConfigError, match="offset"):
        Projector(100, 10, groups=[(-1, 5)])
    with pytest.raises(ConfigError, match="empty"):
        Projector(100, 10, groups=[])
    with pytest.raises(ConfigError, match="offset, size"):
        Projector(100, 10, groups=[(1, 2, 3)])
    p = Projector(100, 10)
    with pytest.raises(InputError, match=r"\[b, 100\]"):
        p.project(torch.zeros(3, 99))
    with pytest.raises(InputError, match=r"\[b, 100\]"):
        p.project(torch.zeros(100))
    with pytest.raises(InputError, match="floating"):
        p.project(torch.zeros(3, 100, dtype=torch.int64))
    with pytest.raises(InputError, match="group"):
        p.matrix_block(1, 0, 10)
    with pytest.raises(InputError, match="outside"):
        p.matrix_block(0, 50, 101)


def test_describe_and_registry() -> None:
    p = create_projection("gaussian", 1000, 32, seed=5, groups=[(0, 600), (600, 400)])
    assert isinstance(p, Projector)
    assert p.describe() == {
        "kind": "gaussian",
        "dim": 32,
        "seed": 5,
        "groups": [[0, 600], [600, 400]],
        "out_dim": 64,
        "dim_in": 1000,
        "hash": HASH_NAME,
    }
    assert Projector(10, 3).describe()["groups"] == [[0, 10]]
    with pytest.raises(ConfigError, match="choices"):
        create_projection("nope", 10, 3)
    with pytest.raises(ValueError, match="already registered"):
        register_projection("rademacher", PROJECTIONS["rademacher"])

    class Ones(ProjectionKind):
        """Every entry 1/sqrt(k): only to show that a registered kind is used."""

        def words_per_row(self, k: int) -> int:
            return 1

        def entries(self, words: torch.Tensor, k: int, out: torch.Tensor) -> torch.Tensor:
            return out.fill_(1 / math.sqrt(k))

    register_projection("test-ones", Ones())
    try:
        q = create_projection("test-ones", 10, 4)
        assert torch.allclose(q.project(torch.ones(2, 10)), torch.full((2, 4), 10 / 2.0))
    finally:
        PROJECTIONS.unregister("test-ones")
