"""Seeded Johnson–Lindenstrauss projection of gradient rows, generated block by block.

Holds:

- ``Projector`` — projects rows ``[b, D]`` to ``[b, out_dim]`` with a random matrix ``R``
  (``[D, k]`` per parameter group) that is never held whole: blocks of ``R``'s rows are
  generated on the rows' device and applied to all ``b`` rows at once (one ``addmm`` per block).
- ``ProjectionKind`` and the two built-in kinds, ``rademacher`` (entries ±1/sqrt(k)) and
  ``gaussian`` (entries N(0, 1/k)); the registry ``PROJECTIONS`` (a ``classgrad.registry.Registry``)
  with ``register_projection`` and ``create_projection``.
- ``mix32`` (the integer hash on tensors), ``stream_keys`` and ``stream_words`` (the counter-based
  word stream every kind draws from), ``HASH_NAME`` (recorded in store attributes).

Why a hash and not ``torch.Generator``: the CPU and CUDA generators produce different streams, so
the same row would project differently on different workers. Here every entry of ``R`` is a pure
function of ``(seed, group, row of R, column)`` computed with integer operations that are exact on
every backend, so a block of ``R`` is bit-identical on CPU and GPU and does not depend on the
block size used to generate it. Only the float summation order of the matmul may differ.

The generator (``HASH_NAME = "classgrad-lowbias32-xor/v1"``), enough to reproduce ``R`` elsewhere.
All arithmetic is on unsigned 32-bit values held in int64 and masked with ``M = 0xFFFFFFFF``;
every multiplication is by a constant below 2^31, so products stay below 2^63 (no overflow on
any backend)::

    mix32(x):  x ^= x >> 16;  x = (x * 0x21F0AAAD) & M;  x ^= x >> 15
               x = (x * 0x735A2D97) & M;  x ^= x >> 15;  return x
               (Wellons' "lowbias32" variant, both multipliers < 2^31)

    stream keys for (seed, group), seed in [0, 2^64), group in [0, 2^32):
        s = 0x636C6772
        for w in (seed & M, seed >> 32, group):  s = mix32(s ^ w)
        key_row = mix32(s ^ 0x52);  key_col = mix32(s ^ 0x43)

    word j of row r of the group's R (r in [0, 2^32), j in [0, words_per_row)):
        a_r = mix32(r ^ key_row)
        b_j = mix32(mix32(j ^ key_col))     # the second mix keeps b_j from coinciding with a_r
        W[r, j] = mix32(a_r ^ b_j)

    rademacher, k columns, words_per_row = ceil(k / 32):
        R[r, c] = +s if bit (c % 32) of W[r, c // 32] is 0 else -s,   s = float32(1 / sqrt(k))

    gaussian, k columns, p = ceil(k / 2) pairs, words_per_row = 2p; pair i fills columns 2i and
    2i + 1 (the last column is dropped when k is odd). Box–Muller, where each step below is one
    IEEE float32 operation (+, -, *, / are correctly rounded on CPU and CUDA; torch's sqrt, log,
    sin and cos are not, so they are written out with those four); float constants are
    float32(value); Horner(z; c_0..c_n) means acc = c_n; acc = acc * z + c_(n-1); ...; + c_0:
        h1 = W[r, i], h2 = W[r, p + i]
        n  = float32((h1 >> 8) | 1)             # odd, < 2^24, exact; u = n / 2^24 in (0, 1)
        e  = floor(log2 n);  m = n / 2^e        # exact (read from n's float32 bits), m in [1, 2)
        t  = (m - 1) / (m + 1);  t2 = t * t     # t in [0, 1/3)
        L  = Horner(t2; 1, 1/3, 1/5, 1/7, 1/9, 1/11);  L = L * t;  L = L * 2     # log m
        lu = float32(e - 24) * ln2 + L          # log u
        v  = max(lu * -2, 2^-100)
        y  = float32 with bits (bits(v) >> 1) + 0x1FBD1DF5;  3 times: y = (v / y + y) * 0.5
        rs = y * float32(1 / sqrt(k))                             # y = sqrt(v) to ~1 ulp
        x  = (float32(h2 >> 10) - (2^21 - 0.5)) * (float32(pi / 2) * 2^-21)   # in (-pi/2, pi/2)
        x2 = x * x
        S  = Horner(x2; 1, -1/3!, 1/5!, ..., -1/11!) * x                     # sin x
        C  = Horner(x2; 1, -1/2!, 1/4!, ..., 1/12!)                          # cos x
        R[r, 2i + 1] = rs * S
        R[r, 2i]     = (rs * (1 if bit 0 of h1 is 0 else -1)) * C
    (bit 0 of h1 reflects the angle into the left half-plane, so it is uniform on the circle)

Groups: with ``groups=[(offset, size), ...]`` each column range of the row is projected with its
own stream ``(seed, group index)`` and its own ``R`` of ``size`` rows (row r of R multiplies
column ``offset + r`` of the row); the outputs are concatenated. ``groups=None`` is one group
``(0, D)``, so ``Projector(D, k)`` equals ``Projector(D, k, groups=[(0, D)])``.

Throughput and the batch size b: generating a block of ``R`` costs the same whatever b is
(rademacher: ~0.7 ns per entry on one CPU core; gaussian ~15 ns), while the matmul costs
``2 * b * block_rows * k`` flops, so the share of time spent generating falls as b grows:
projection/matmul throughput is roughly t_mm(b) / (t_mm(b) + t_gen). Measured on a 2-core
CPU at k = 4096, D = 2^20 (rademacher): ~0.45 at b = 64, ~0.8 at b = 256 and 1024. Project
hundreds of rows per call when memory allows (``benchmarks/projection.py`` measures this).
"""

from __future__ import annotations

import logging
import math
import operator
from collections.abc import Sequence
from typing import Any

import torch

from classgrad.config.choices import PROJECTION_KINDS
from classgrad.errors import ConfigError, InputError
from classgrad.registry import Registry

logger = logging.getLogger(__name__)

HASH_NAME = "classgrad-lowbias32-xor/v1"

MASK32 = 0xFFFFFFFF
_MUL1 = 0x21F0AAAD  # < 2^31: x (< 2^32) * _MUL1 < 2^63, so int64 never overflows
_MUL2 = 0x735A2D97  # < 2^31, same reason
_STREAM_IV = 0x636C6772  # "clgr"
_ROW_TAG = 0x52  # "R"
_COL_TAG = 0x43  # "C"
_MAX_INDEX = 1 << 32  # rows of one group's R and groups are 32-bit counters
_MAX_SEED = 1 << 64

# Default number of R entries per generated block (block_rows * k), by device type. On a CPU,
# 2^22 entries (16 MiB for rademacher; 1024 rows at k = 4096) balanced generation, which
# prefers blocks small enough to stay in cache until the matmul reads them, against the matmul,
# which prefers tall blocks when b is large (benchmarks/projection.py --block-rows sweeps this).
# On a GPU, large blocks keep the dozen small generation kernels per block from being
# launch-bound. Pass block_rows to override; it never changes R.
_DEFAULT_BLOCK_ENTRIES = {"cpu": 1 << 22, "cuda": 1 << 25}
_FALLBACK_BLOCK_ENTRIES = 1 << 23


def _f32(value: float) -> float:
    """``value`` rounded to float32 (returned as a Python float that float32 holds exactly).

    Constants enter every float32 operation already rounded, so no backend can use a
    higher-precision copy of them and results stay bit-identical across devices.
    """
    return float(torch.tensor(value, dtype=torch.float32).item())


def mix32_int(x: int) -> int:
    """``mix32`` on one Python int in [0, 2^32) (used for the stream keys)."""
    x &= MASK32
    x ^= x >> 16
    x = (x * _MUL1) & MASK32
    x ^= x >> 15
    x = (x * _MUL2) & MASK32
    x ^= x >> 15
    return x


def mix32_(x: torch.Tensor, scratch: torch.Tensor | None = None) -> torch.Tensor:
    """``mix32`` in place on a contiguous int64 tensor whose values lie in [0, 2^32); returns
    ``x``. ``scratch`` (same shape and dtype) avoids one allocation per shift. Exact on every
    backend: values stay in [0, 2^32) and products below 2^63."""
    if x.dtype != torch.int64:
        raise TypeError(f"mix32 needs an int64 tensor, got {x.dtype}")
    if scratch is None:
        scratch = torch.empty_like(x)
    torch.bitwise_right_shift(x, 16, out=scratch)
    x.bitwise_xor_(scratch)
    x.mul_(_MUL1).bitwise_and_(MASK32)
    torch.bitwise_right_shift(x, 15, out=scratch)
    x.bitwise_xor_(scratch)
    x.mul_(_MUL2).bitwise_and_(MASK32)
    torch.bitwise_right_shift(x, 15, out=scratch)
    x.bitwise_xor_(scratch)
    return x


def mix32(x: torch.Tensor) -> torch.Tensor:
    """``mix32`` elementwise on an int64 tensor with values in [0, 2^32); returns a new tensor."""
    return mix32_(x.clone(memory_format=torch.contiguous_format))


def stream_keys(seed: int, group: int) -> tuple[int, int]:
    """``(key_row, key_col)`` of the stream for ``(seed, group)`` (see the module docstring)."""
    if not 0 <= seed < _MAX_SEED:
        raise ConfigError(f"projection.seed must be in [0, 2^64), got {seed}")
    if not 0 <= group < _MAX_INDEX:
        raise ConfigError(f"projection group index must be in [0, 2^32), got {group}")
    s = _STREAM_IV
    for word in (seed & MASK32, seed >> 32, group):
        s = mix32_int(s ^ word)
    return mix32_int(s ^ _ROW_TAG), mix32_int(s ^ _COL_TAG)


def stream_words(
    keys: tuple[int, int], start: int, stop: int, words_per_row: int, device: torch.device | str
) -> torch.Tensor:
    """Words ``W[r, j]`` for rows ``start <= r < stop`` and ``0 <= j < words_per_row``: an int64
    tensor ``[stop - start, words_per_row]`` with values in [0, 2^32), on ``device``."""
    if not 0 <= start <= stop <= _MAX_INDEX:
        raise ValueError(f"row range [{start}, {stop}) outside [0, 2^32)")
    key_row, key_col = keys
    r = torch.arange(start, stop, dtype=torch.int64, device=device)
    a = mix32_(r.bitwise_xor_(key_row))
    j = torch.arange(words_per_row, dtype=torch.int64, device=device)
    b = mix32_(mix32_(j.bitwise_xor_(key_col)))
    return mix32_(a.unsqueeze(1) ^ b.unsqueeze(0))


# --------------------------------------------------------------------------------------------
# Kinds: how a block of stream words becomes a block of R's entries.


class ProjectionKind:
    """Turns stream words into entries of R. Subclass and ``register_projection`` to add one.

    ``words_per_row(k)`` says how many 32-bit words one row of R with ``k`` columns consumes;
    ``entries(words, k, out)`` writes float32 entries ``[rows, k]`` into ``out`` (may be a view
    of a reused buffer) and returns it. Entries must have mean 0 and variance 1/k, so that
    ``E[<Rx, Ry>] = <x, y>``.
    """

    name: str = ""

    def words_per_row(self, k: int) -> int:
        raise NotImplementedError

    def buffer_cols(self, k: int) -> int:
        """Columns of the scratch buffer ``entries`` writes into (``>= k``)."""
        return k

    def chunk_rows(self, k: int, device_type: str) -> int:
        """Rows of R to generate per ``entries`` call (words included), to bound temporaries."""
        return 1 << 31

    def entries(self, words: torch.Tensor, k: int, out: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class Rademacher(ProjectionKind):
    """Entries ±1/sqrt(k): 32 signs per hashed word, expanded byte by byte through a 256 x 8
    lookup table (one gather writes the float block; no per-bit arithmetic on the big block)."""

    name = "rademacher"

    def __init__(self) -> None:
        self._tables: dict[tuple[str, float], torch.Tensor] = {}
        self._shifts: dict[str, torch.Tensor] = {}

    def words_per_row(self, k: int) -> int:
        return -(-k // 32)

    def buffer_cols(self, k: int) -> int:
        return 32 * self.words_per_row(k)

    def _table(self, scale: float, device: torch.device) -> torch.Tensor:
        key = (str(device), scale)
        table = self._tables.get(key)
        if table is None:
            # table[v, i] = +scale if bit i of byte v is 0, else -scale.
            bits = (torch.arange(256).unsqueeze(1) >> torch.arange(8).unsqueeze(0)) & 1
            table = torch.where(bits == 0, scale, -scale).to(torch.float32).to(device)
            self._tables[key] = table
        return table

    def entries(self, words: torch.Tensor, k: int, out: torch.Tensor) -> torch.Tensor:
        rows, n_words = words.shape
        device = words.device
        shifts = self._shifts.get(str(device))
        if shifts is None:
            shifts = torch.tensor([0, 8, 16, 24], dtype=torch.int64, device=device)
            self._shifts[str(device)] = shifts
        # Byte i of word w holds the signs of columns 32w + 8i ... 32w + 8i + 7.
        byte_idx = (words.unsqueeze(-1) >> shifts).bitwise_and_(255).view(-1)
        table = self._table(_f32(1.0 / math.sqrt(k)), device)
        full = out.view(rows * n_words * 4, 8)
        torch.index_select(table, 0, byte_idx, out=full)
        return out[:, :k]


def _f32_list(values: Sequence[float]) -> list[float]:
    return [_f32(v) for v in values]


# Taylor coefficients, float32-rounded once here (lowest power first).
# Truncation errors, far below what any statistic over R could detect (and below float32's
# resolution for cos and sin): cos to x^12 on |x| < pi/2: < (pi/2)^14/14! = 6e-9;
# sin to x^11: < (pi/2)^13/13! = 6e-8; atanh(t)/t to t^10 on t < 1/3: relative < 3^-12/13 = 1.5e-7.
_COS_COEFFS = _f32_list([(-1) ** i / math.factorial(2 * i) for i in range(7)])  # x^0 ... x^12
_SIN_COEFFS = _f32_list([(-1) ** i / math.factorial(2 * i + 1) for i in range(6)])  # x^1 ... x^11
_LOG_COEFFS = _f32_list([1 / (2 * i + 1) for i in range(6)])  # atanh(t)/t: t^0 ... t^10
_LN2 = _f32(math.log(2.0))
_ANGLE_STEP = _f32(math.pi / 2) * 2.0**-21  # exact: a power-of-two multiple of float32(pi/2)
_ANGLE_OFFSET = 2.0**21 - 0.5  # exact in float32; (f - offset) is a half-integer in (-2^21, 2^21)


_TINY = 2.0**-100  # keeps the square root's argument a positive normal float


def _sqrt(v: torch.Tensor) -> torch.Tensor:
    """sqrt of a float32 tensor of positive normal numbers, from + * / only (in place).

    torch.sqrt is not correctly rounded on every CPU path (vectorized, it is within 0.5001 ulp,
    and the vector body and scalar tail can differ), so it would break CPU/GPU bit-identity.
    Start from an integer estimate on the float's bits (relative error < 4%, exact int32 ops on
    a positive pattern: (bits >> 1) + 0x1FBD1DF5 < 2^31), then three Newton steps
    y = (y + v / y) * 0.5, each correctly rounded: error 4e-2 -> 8e-4 -> 3e-7 -> ~1 ulp.
    """
    y = (v.view(torch.int32) >> 1).add_(0x1FBD1DF5).view(torch.float32)
    for _ in range(3):
        y = (v / y).add_(y).mul_(0.5)
    return y


def _horner(x2: torch.Tensor, coeffs: Sequence[float]) -> torch.Tensor:
    """sum_i coeffs[i] * x2^i, highest power first; each step is one float32 mul then one add
    (separate kernels, so no backend fuses them into an FMA and results stay bit-identical)."""
    acc = torch.full_like(x2, coeffs[-1])
    for c in reversed(coeffs[:-1]):
        acc.mul_(x2).add_(c)
    return acc


class Gaussian(ProjectionKind):
    """Entries N(0, 1/k) by Box–Muller from two hashed uniforms, with log, sin and cos written
    as float32 polynomials (see the module docstring) so that every device gets the same bits.
    The 24-bit radius uniform caps the radius at sqrt(48 ln 2) = 5.77 (a Gaussian radius goes
    beyond that with probability 2^-24), so |entry| * sqrt(k) <= 5.77. Generating it takes
    about 60 elementwise passes over half-size tensors instead of ``rademacher``'s one gather:
    an order of magnitude slower on a CPU, cheap on a GPU."""

    name = "gaussian"

    def words_per_row(self, k: int) -> int:
        return 2 * -(-k // 2)

    def buffer_cols(self, k: int) -> int:
        return self.words_per_row(k)

    def chunk_rows(self, k: int, device_type: str) -> int:
        # Rows per pass through the ~60 elementwise steps. On a CPU, 2^16 pairs keep each
        # float32 temporary at 256 KiB, inside a core's L2 cache (measured ~1.6x faster than
        # passes over whole blocks); on a GPU, 2^22 pairs keep kernels large.
        target = (1 << 16) if device_type == "cpu" else (1 << 22)
        return max(1, target // self.words_per_row(k) * 2)

    def entries(self, words: torch.Tensor, k: int, out: torch.Tensor) -> torch.Tensor:
        self._entries(words, k, out)
        return out[:, :k]

    def _entries(self, words: torch.Tensor, k: int, out: torch.Tensor) -> None:
        rows, n_words = words.shape
        pairs = n_words // 2
        h1 = words[:, :pairs]
        h2 = words[:, pairs:]
        # Radius sqrt(-2 log u), u = n / 2^24: n is the top 24 bits of h1 with the lowest one
        # forced to 1 (so u > 0), exact in float32. Its exponent and mantissa are read from the
        # float's bits (int32 ops on a positive pattern: exact everywhere; frexp is slow on CPU).
        bits = (h1 >> 8).bitwise_or_(1).to(torch.float32).view(torch.int32)
        m = (bits & 0x7FFFFF).bitwise_or_(0x3F800000).view(torch.float32)  # n / 2^e in [1, 2)
        e = (bits >> 23).sub_(127 + 24).to(torch.float32)  # e - 24, exact
        del bits
        t = (m - 1.0).div_(m.add_(1.0))  # in [0, 1/3)
        del m
        log_u = _horner(t * t, _LOG_COEFFS).mul_(t).mul_(2.0)  # log m = 2 atanh t
        del t
        log_u = e.mul_(_LN2).add_(log_u)
        del e
        rad = _sqrt(log_u.mul_(-2.0).clamp_(min=_TINY)).mul_(_f32(1.0 / math.sqrt(k)))
        del log_u
        # Angle x in (-pi/2, pi/2) from 22 bits of h2; bit 0 of h1 flips the cosine's sign,
        # reflecting x into the left half-plane, so the angle is uniform on the circle.
        x = (h2 >> 10).to(torch.float32).sub_(_ANGLE_OFFSET).mul_(_ANGLE_STEP)
        x2 = x * x
        pair_view = out.view(rows, pairs, 2)
        sin_x = _horner(x2, _SIN_COEFFS).mul_(x)
        torch.mul(rad, sin_x, out=pair_view[:, :, 1])
        del sin_x, x
        cos_x = _horner(x2, _COS_COEFFS)
        del x2
        sign = (h1 & 1).mul_(-2).add_(1).to(torch.float32)  # +1 or -1
        torch.mul(rad.mul_(sign), cos_x, out=pair_view[:, :, 0])


PROJECTIONS: Registry[ProjectionKind] = Registry(
    "projection kind",
    unknown="projection.kind {name!r} is unknown (choices: {choices})",
    error=ConfigError,
    choices=PROJECTION_KINDS,
)


def register_projection(name: str, kind: ProjectionKind, *, replace: bool = False) -> None:
    """Adds a projection kind under ``name`` (an error if taken, unless ``replace``)."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"projection kind name must be a non-empty string, got {name!r}")
    if not isinstance(kind, ProjectionKind):
        raise TypeError(f"projection kind {name!r} must be a ProjectionKind, got {type(kind).__name__}")
    PROJECTIONS.register(name, kind, replace=replace)


register_projection("rademacher", Rademacher())
register_projection("gaussian", Gaussian())


def _get_kind(name: str) -> ProjectionKind:
    return PROJECTIONS.get(name)


# --------------------------------------------------------------------------------------------


def _check_int(name: str, value: Any, minimum: int) -> int:
    # operator.index accepts Python and numpy integers but not floats; bools are refused too.
    try:
        if isinstance(value, bool):
            raise TypeError
        value = operator.index(value)
    except TypeError:
        raise ConfigError(f"{name} must be an integer, got {value!r}") from None
    if value < minimum:
        raise ConfigError(f"{name} must be >= {minimum}, got {value}")
    return value


class Projector:
    """Projects rows [b, D] -> [b, out_dim] (see the module docstring for R's definition).

    ``dim_in`` is D, ``dim`` is k per group, ``kind`` a name in ``PROJECTIONS``, ``seed`` an
    integer in [0, 2^64). ``groups``: optional ``(offset, size)`` column ranges of the row (one
    per parameter group, any order, no overlap; columns outside every group are ignored), each
    projected to ``dim`` columns with its own stream ``(seed, group index)``; the output is
    their concatenation in the order given, so ``out_dim = len(groups) * dim``. ``None`` is one
    group over the whole row. ``block_rows``: rows of R generated per block (``None``: chosen
    per device, see ``block_rows_for``); it changes speed and memory, never R.

    ``project`` computes in float32 with torch's matmul, so it follows
    ``torch.backends.cuda.matmul.allow_tf32``: leave TF32 off (torch's default) for CPU and GPU
    results to agree to float32 rounding.
    """

    def __init__(
        self,
        dim_in: int,
        dim: int,
        *,
        kind: str = "rademacher",
        seed: int = 0,
        groups: Sequence[tuple[int, int]] | None = None,
        block_rows: int | None = None,
    ) -> None:
        self.dim_in = _check_int("projection dim_in", dim_in, 1)
        self.dim = _check_int("projection.dim", dim, 1)
        self.kind = kind
        self._kind = _get_kind(kind)
        self.seed = _check_int("projection.seed", seed, 0)
        if seed >= _MAX_SEED:
            raise ConfigError(f"projection.seed must be below 2^64, got {seed}")
        self.groups = self._check_groups(groups)
        self.out_dim = len(self.groups) * self.dim
        if block_rows is not None:
            _check_int("projection block_rows", block_rows, 1)
        self.block_rows = block_rows  # None: chosen per device by block_rows_for()
        self._keys = [stream_keys(self.seed, g) for g in range(len(self.groups))]
        logger.debug("projector %s k=%d groups=%d block_rows=%s", kind, dim, len(self.groups), block_rows)

    def block_rows_for(self, device: torch.device | str) -> int:
        """Rows of R generated per block when projecting on ``device``."""
        if self.block_rows is not None:
            return self.block_rows
        entries = _DEFAULT_BLOCK_ENTRIES.get(torch.device(device).type, _FALLBACK_BLOCK_ENTRIES)
        return max(1, entries // self._kind.buffer_cols(self.dim))

    def buffers(self) -> list[tuple[str, int, str]]:
        """A block of R at a time (float32), for the footprint."""
        return [
            (
                "projection matrix block",
                self.block_rows_for("cpu") * self._kind.buffer_cols(self.dim) * 4,
                "projection.dim",
            )
        ]

    def _check_groups(self, groups: Sequence[tuple[int, int]] | None) -> list[tuple[int, int]]:
        if groups is None:
            groups = [(0, self.dim_in)]
        checked: list[tuple[int, int]] = []
        for i, group in enumerate(groups):
            try:
                offset, size = group
            except (TypeError, ValueError):
                raise ConfigError(f"projection group {i} must be (offset, size), got {group!r}") from None
            offset = _check_int(f"projection group {i} offset", offset, 0)
            size = _check_int(f"projection group {i} size", size, 1)
            if offset + size > self.dim_in:
                raise ConfigError(
                    f"projection group {i} ({offset}, {size}) ends at {offset + size}, past the row width {self.dim_in}"
                )
            if size >= _MAX_INDEX:
                raise ConfigError(
                    f"projection group {i} has {size} columns; at most 2^32 - 1 per group (split the row into groups)"
                )
            checked.append((offset, size))
        if not checked:
            raise ConfigError("projection groups must not be empty")
        if len(checked) >= _MAX_INDEX:
            raise ConfigError("too many projection groups")
        ordered = sorted(range(len(checked)), key=lambda i: checked[i][0])
        for a, b in zip(ordered, ordered[1:]):
            if checked[a][0] + checked[a][1] > checked[b][0]:
                raise ConfigError(f"projection groups {a} {checked[a]} and {b} {checked[b]} overlap")
        return checked

    def _check_group_range(self, group: int, start: int, stop: int) -> int:
        if isinstance(group, bool) or not isinstance(group, int) or not 0 <= group < len(self.groups):
            raise InputError(f"group must be in [0, {len(self.groups)}), got {group!r}")
        size = self.groups[group][1]
        if not (isinstance(start, int) and isinstance(stop, int) and 0 <= start <= stop <= size):
            raise InputError(f"rows [{start}, {stop}) outside group {group}'s [0, {size})")
        return size

    def _generate(
        self, group: int, start: int, stop: int, device: torch.device, buffer: torch.Tensor | None
    ) -> torch.Tensor:
        """Rows [start, stop) of group's R (a view of ``buffer`` when it is given and large
        enough, else of a new tensor)."""
        kind, k = self._kind, self.dim
        cols = kind.buffer_cols(k)
        rows = stop - start
        if buffer is None or buffer.numel() < rows * cols:
            buffer = torch.empty(rows * cols, dtype=torch.float32, device=device)
        out = buffer[: rows * cols].view(rows, cols)
        chunk = kind.chunk_rows(k, device.type)
        for r0 in range(start, stop, chunk):
            r1 = min(stop, r0 + chunk)
            words = stream_words(self._keys[group], r0, r1, kind.words_per_row(k), device)
            kind.entries(words, k, out[r0 - start : r1 - start])
        return out[:, :k]

    def matrix_block(self, group: int, start: int, stop: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """Rows [start, stop) of group's R: float32 [stop - start, dim] on ``device``."""
        self._check_group_range(group, start, stop)
        return self._generate(group, start, stop, torch.device(device), None).contiguous()

    def project(self, rows: torch.Tensor) -> torch.Tensor:
        """float32 [b, out_dim] = rows @ R per group, on rows.device (not differentiable)."""
        if not isinstance(rows, torch.Tensor):
            raise InputError(f"rows must be a torch.Tensor, got {type(rows).__name__}")
        if rows.dim() != 2 or rows.shape[1] != self.dim_in:
            raise InputError(f"rows must have shape [b, {self.dim_in}], got {list(rows.shape)}")
        if not rows.is_floating_point():
            raise InputError(f"rows must be floating point, got {rows.dtype}")
        rows = rows.detach()
        device = rows.device
        b = rows.shape[0]
        out = torch.zeros(b, self.out_dim, dtype=torch.float32, device=device)
        if b == 0:
            return out
        k = self.dim
        block_rows = self.block_rows_for(device)
        largest = min(block_rows, max(size for _, size in self.groups))
        # One scratch buffer for every block: reallocating (and page-faulting) a large block
        # each time costs as much as generating it.
        buffer = torch.empty(largest * self._kind.buffer_cols(k), dtype=torch.float32, device=device)
        with torch.no_grad():
            for g, (offset, size) in enumerate(self.groups):
                acc = torch.zeros(b, k, dtype=torch.float32, device=device)
                for start in range(0, size, block_rows):
                    stop = min(size, start + block_rows)
                    block = self._generate(g, start, stop, device, buffer)
                    x = rows[:, offset + start : offset + stop]
                    if x.dtype != torch.float32:
                        x = x.float()
                    acc.addmm_(x, block)
                out[:, g * k : (g + 1) * k] = acc
        return out

    def describe(self) -> dict[str, Any]:
        """What a store records about the projection (JSON-friendly)."""
        return {
            "kind": self.kind,
            "dim": self.dim,
            "seed": self.seed,
            "groups": [[offset, size] for offset, size in self.groups],
            "out_dim": self.out_dim,
            "dim_in": self.dim_in,
            "hash": HASH_NAME,
        }

    def __repr__(self) -> str:
        return (
            f"Projector(dim_in={self.dim_in}, dim={self.dim}, kind={self.kind!r}, seed={self.seed}, "
            f"groups={len(self.groups)}, block_rows={self.block_rows})"
        )


def create_projection(
    kind: str,
    dim_in: int,
    dim: int,
    *,
    seed: int = 0,
    groups: Sequence[tuple[int, int]] | None = None,
    block_rows: int | None = None,
) -> Projector:
    """A ``Projector`` of a registered kind (an unknown kind raises an error listing them)."""
    _get_kind(kind)
    return Projector(dim_in, dim, kind=kind, seed=seed, groups=groups, block_rows=block_rows)
