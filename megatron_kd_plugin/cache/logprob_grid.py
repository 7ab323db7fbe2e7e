"""The log-prob grid codec: each row of top-K log-probs as one float16 maximum and K 8-bit codes on a fixed grid
below it (a numcodecs codec, and the zarr v3 serializer ``numcodecs.kd_logprob_grid`` that wraps it).

Math, per row of K log-probs ℓ_k (any order; −inf marks a padding slot)::

    m̃   = float16(max_k ℓ_k)                       (round to nearest; −inf for a row of padding only)
    u_k  = m̃ − ℓ_k                                  (>= 0 up to the rounding of m̃)
    grid g_0 = 0 < g_1 < … < g_{n-1}, n <= 255:     g_{j+1} = g_j + min(step · exp(growth · g_j), max_step),
                                                    while <= span; each g_j rounded to a multiple of 2^-12
    c_k  = the j whose g_j is nearest to u_k in the divergence below (u_k beyond the grid: n − 1); 255 for −inf;
           then, in a row whose decoded mass M' = Σ_k e^ℓ'_k misses M = Σ_k e^ℓ_k by more than 0.05·(1 − M),
           single codes move to their other neighbouring grid point, each time the move that brings M' nearest
           to M, until it is within that (or no move brings it nearer): the ghost bucket keeps its mass to 5 %
    ℓ'_k = float32(m̃) − float32(g_{c_k})           (decoded; −inf for code 255)

The divergence: the stored row's round-trip KL over the K + 1 ghost buckets (the loss's partition) is, to first
order in the tail's mass error, Σ_k d(p_k, p'_k) with d(p, q) = p log(p/q) − p + q on the unnormalised probabilities
p = e^ℓ. Between two grid points g_j < g_{j+1} it picks g_j iff p_k/e^m̃ > (e^{−g_j} − e^{−g_{j+1}}) / (g_{j+1} − g_j)
(their logarithmic mean), which ``LogprobGrid.boundaries`` tabulates. Near the maximum a log error δ costs
½·p·δ², so equal cost per slot wants steps growing like p^(−1/2): ``growth`` = 0.5 makes the grid uniform in
sqrt(p / p_max) (steps ``step``·e^(u/2)) until ``max_step`` caps them; ``growth`` = 0 is a plain log grid of step
``step``. The grid points are dyadic (multiples of 2^-12 below 2^5), exact in float32, so the decoded values are the
same on every machine; m̃ costs 2 bytes per row and its rounding shifts the whole row by at most 2^-11·|m|.

Encoded bytes of a chunk of R rows: the R float16 maxima, their high bytes then their low bytes (2R), then the
R·K codes (uint8, row-major): R·(K + 2) bytes, compressed by the chunk's compressors. A NaN or +inf log-prob is
refused (ValueError): the writer never stores one.
"""

from __future__ import annotations

import functools

import numcodecs
import numpy as np
from numcodecs.abc import Codec
from zarr.codecs.numcodecs import _NumcodecsArrayBytesCodec
from zarr.registry import register_codec

PAD_CODE = 255
"""The code of a −inf (padding) slot."""
TAIL_SLACK = 0.05
"""A row's decoded top-K mass may miss its exact mass M by at most this share of the ghost mass 1 − M (where a code
move can bring it there)."""
BIN = 2.0 ** -8
"""Width (nats) of the encoder's lookup bins; grid steps must be wider."""
GRID_QUANTUM = 2.0 ** -12
"""Every grid point is a multiple of this (exact in float32 below 2^11)."""


@functools.lru_cache(maxsize=32)
def grid_points(step: float, growth: float, max_step: float, span: float) -> np.ndarray:
    """The grid g_0..g_{n-1} (float64, multiples of :data:`GRID_QUANTUM`, n <= 255) of the module docstring."""
    if not (0 < step <= max_step and growth >= 0 and 0 < span <= 32):
        raise ValueError(f"log-prob grid: need 0 < step <= max_step, growth >= 0 and 0 < span <= 32; got step={step}, "
                         f"growth={growth}, max_step={max_step}, span={span}")
    points = [0.0]
    while len(points) < PAD_CODE:
        following = points[-1] + min(step * np.exp(growth * points[-1]), max_step)
        if following > span:
            break
        points.append(following)
    grid = np.unique(np.round(np.asarray(points) / GRID_QUANTUM) * GRID_QUANTUM)
    if len(grid) < 2:
        raise ValueError(f"log-prob grid: step={step} leaves fewer than 2 points below span={span}")
    return grid


class LogprobGrid(Codec):
    """numcodecs codec of rows of ``slots`` log-probs (module docstring); decodes to float32."""

    codec_id = "kd_logprob_grid"

    def __init__(self, slots: int, step: float, growth: float, max_step: float, span: float):
        if int(slots) < 1:
            raise ValueError(f"log-prob grid: slots must be >= 1, got {slots}")
        self.slots, self.step, self.growth = int(slots), float(step), float(growth)
        self.max_step, self.span = float(max_step), float(span)
        self.grid = grid_points(self.step, self.growth, self.max_step, self.span)
        self.values = np.full(PAD_CODE + 1, np.inf, dtype=np.float32)                  # code -> g_code (PAD: inf)
        self.values[:len(self.grid)] = self.grid
        g = self.grid
        self.boundaries = -np.log((np.exp(-g[:-1]) - np.exp(-g[1:])) / (g[1:] - g[:-1]))   # between g_j, g_j+1
        # the code of an offset u by lookup (what searchsorted(boundaries, u) gives): bins of width BIN hold at
        # most one boundary each, so code = first[bin] + (u > the boundary at first[bin])
        if np.diff(self.boundaries).min() <= BIN:
            raise ValueError(f"log-prob grid: steps below {BIN} nats (step={step}) are finer than the encoder's bins")
        self._first = np.searchsorted(self.boundaries, np.arange(int(span / BIN) + 2) * BIN, side="right")
        self._next = np.append(self.boundaries, np.inf)

    def get_config(self):
        return dict(id=self.codec_id, slots=self.slots, step=self.step, growth=self.growth, max_step=self.max_step,
                    span=self.span)

    def encode(self, buf) -> bytes:
        values = np.asarray(buf, dtype=np.float64)
        if values.size % self.slots:
            raise ValueError(f"log-prob grid: {values.size} values are not rows of {self.slots} slots")
        rows = values.reshape(-1, self.slots)
        if np.isnan(rows).any() or np.isposinf(rows).any():
            raise ValueError("log-prob grid: a log-prob is NaN or +inf (only finite values and -inf padding are "
                             "stored)")
        maxima = rows.max(axis=1).astype(np.float16)                                  # [R]
        with np.errstate(invalid="ignore"):                                           # -inf - -inf: padding only
            offsets = maxima.astype(np.float64)[:, None] - rows                       # [R, K], +inf on padding
        codes = self._nearest(np.where(np.isfinite(offsets), offsets, 0.0))
        codes[np.isneginf(rows)] = PAD_CODE
        self._balance_mass(rows, maxima, codes)
        planes = maxima.view(np.uint8).reshape(-1, 2)[:, ::-1].T                      # high bytes, then low
        return np.ascontiguousarray(planes).tobytes() + codes.tobytes()

    def _nearest(self, offsets: np.ndarray) -> np.ndarray:
        """uint8 codes of offsets u >= 0 (``searchsorted(boundaries, u)``, by the bin lookup of ``__init__``)."""
        bins = np.minimum(np.maximum(offsets, 0.0) * (1 / BIN), len(self._first) - 1).astype(np.intp)
        first = np.take(self._first, bins)
        return (first + (offsets > np.take(self._next, first))).astype(np.uint8)

    def _balance_mass(self, rows: np.ndarray, maxima: np.ndarray, codes: np.ndarray) -> None:
        """In every row whose decoded top-K mass M' misses the exact mass M by more than :data:`TAIL_SLACK`·(1 − M),
        moves one slot's code to its other neighbouring grid point (in place), the move that brings M' nearest to
        M, until |M' − M| <= the slack or no move brings it nearer (each move does: this ends). The ghost bucket's
        mass 1 − M' then stays within 5 % of the exact 1 − M, so its term of the round-trip KL stays below
        ~TAIL_SLACK²·(1 − M)/2 (nearest rounding alone can leave 1 − M' ~0 in a confident row: unbounded)."""
        exact = np.exp(rows).sum(axis=1)
        slack = TAIL_SLACK * np.clip(1 - exact, 0, None)
        top = len(self.grid) - 1
        base = maxima.astype(np.float32)[:, None]
        probs = np.exp((base - np.take(self.values, codes)).astype(np.float64))          # [R, K] decoded
        mass = probs.sum(axis=1)
        for _ in range(self.slots * 4):
            off = np.flatnonzero(np.abs(mass - exact) > slack)
            if not len(off):
                return
            now, wanted = codes[off].astype(np.int64), (mass - exact)[off, None]
            real = now != PAD_CODE
            moved = np.where(wanted > 0, np.where(real & (now < top), now + 1, now),      # too much mass: down
                             np.where(real & (now > 0), now - 1, now))                     # too little: up
            change = np.exp((base[off] - self.values[moved]).astype(np.float64)) - probs[off]
            after = np.where(moved != now, np.abs(wanted + change), np.inf)
            slot = after.argmin(axis=1)
            better = after[np.arange(len(off)), slot] < np.abs(wanted[:, 0])
            if not better.any():
                return
            row, slot = off[better], slot[better]
            codes[row, slot] = moved[better, slot]
            probs[row, slot] = np.exp((base[row, 0] - self.values[codes[row, slot]]).astype(np.float64))
            mass[row] = probs[row].sum(axis=1)

    def decode(self, buf, out=None) -> np.ndarray:
        data = np.frombuffer(buf, dtype=np.uint8) if not isinstance(buf, np.ndarray) else buf.reshape(-1).view(np.uint8)
        if data.size % (self.slots + 2):
            raise ValueError(f"log-prob grid: {data.size} bytes are not rows of 2 + {self.slots}")
        rows = data.size // (self.slots + 2)
        maxima = np.ascontiguousarray(data[:2 * rows].reshape(2, rows)[::-1].T).view(np.float16)   # [R, 1]
        codes = data[2 * rows:].reshape(rows, self.slots)
        decoded = maxima.astype(np.float32) - np.take(self.values, codes)                # [R, K]; pad: -inf
        if out is not None:
            out = np.asarray(out).reshape(-1).view(np.float32)
            out[:] = decoded.reshape(-1)
            return out
        return decoded.reshape(-1)


class LogprobGridZarr(_NumcodecsArrayBytesCodec, codec_name=LogprobGrid.codec_id):
    """The zarr v3 serializer ``numcodecs.kd_logprob_grid`` (float32 arrays)."""


numcodecs.register_codec(LogprobGrid)
register_codec(LogprobGridZarr.codec_name, LogprobGridZarr)
