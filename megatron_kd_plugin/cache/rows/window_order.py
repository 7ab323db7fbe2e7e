"""The order in which one epoch reads its windows: a keyed bijection of [0, n) computed one position at a time, so the
order of an epoch of n windows costs O(1) memory instead of an array of n (issue #37: 8 bytes a window in every
process and DataLoader worker, ~1.7 GB at 10^11 tokens of S = 512).

    window = WindowOrder(n, seed=seed, epoch=epoch)(position)         position, window in [0, n)

The math. Let b = max(1, ceil(log2 n)), so 2^(b-1) < n <= 2^b (n >= 2), and split a b-bit number x into its high
h = floor(b / 2) bits and its low l = b - h bits, x = H · 2^l + L. One half-round r, keyed by the 64-bit word k_r,
changes one half by a function of the other:

    r even:  L <- L xor (M(k_r xor H) mod 2^l)
    r odd:   H <- H xor (M(k_r xor L) mod 2^h)

Each half-round is its own inverse (the half it reads is unchanged), so R of them in a row are a bijection P of
[0, 2^b): an unbalanced Feistel network (two half-rounds are one Feistel round; the unequal halves of odd b cost no
swap). M is SplitMix64's finaliser, a bijective avalanche mix of a 64-bit word:

    M(z) = z3,  z1 = (z xor z >> 30) · 0xBF58476D1CE4E5B9,  z2 = (z1 xor z1 >> 27) · 0x94D049BB133111EB,
                z3 = z2 xor z2 >> 31                                     (all mod 2^64)

and the round keys (k_0 .. k_{R-1}) are numpy's ``SeedSequence([seed, epoch])`` words, so each (seed, epoch) is
its own permutation. P permutes 2^b <= 2n values; cycle-walking restricts it to [0, n):

    order(x) = the first of P(x), P(P(x)), ... that is < n

that is, each member of [0, n) goes to the next member on its cycle of P: the permutation P induces on [0, n), a
bijection. A walk takes 2^b / n <= 2 steps on average over x.

Shapes: ``order(position)`` an int; ``order.windows(positions)`` [m] (any shape) -> [m] int64.

R, the number of half-rounds: 12 (six Feistel rounds; Luby and Rackoff's four already make a strong pseudo-random
permutation of balanced halves and random round functions), and more on small domains, whose half-rounds carry few key bits:
R = max(12, 2 · ceil(48 / b)) (b = 1: 96, b = 3: 32, b >= 8: 12). With R = 16 at b = 3 the 720 orders of n = 6
still came unevenly over 72,000 keys (chi-square 6 standard deviations over its mean); with 24 they come evenly.

Cost (measured, a shared 2-core machine at load ~4): ~6 us a position through ``KDRows.window_of`` at n = 10^6 and
at n = 10^9 (~170,000 rows/s; the permutation array it replaces: ~0.6 us a row, after drawing 8 bytes a window per
epoch, 6.5 s at n = 10^8), 12 us a new epoch's keys; ``windows`` does 10^6 positions in ~0.1 s.
"""

from __future__ import annotations

import math

import numpy as np

_MASK64 = (1 << 64) - 1
_MUL1, _MUL2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB


class WindowOrder:
    """The bijection ``position -> window`` of [0, ``n``) for epoch ``epoch`` of a run seeded ``seed`` (module
    docstring). Holds R round keys, nothing of size n."""

    def __init__(self, n: int, *, seed: int, epoch: int):
        if not 1 <= n <= 2**63:
            raise ValueError(f"n={n}: expected 1 <= n <= 2**63 windows")
        if seed < 0 or epoch < 0:
            raise ValueError(f"seed={seed}, epoch={epoch}: expected both >= 0")
        self.n, self.seed, self.epoch = n, seed, epoch
        bits = max(1, (n - 1).bit_length())
        self._high_bits = bits // 2
        self._low_bits = bits - self._high_bits
        self._low_mask, self._high_mask = (1 << self._low_bits) - 1, (1 << self._high_bits) - 1
        rounds = _half_rounds(bits)
        keys = np.random.SeedSequence([seed, epoch]).generate_state(rounds, np.uint64)
        self._keys = [(int(keys[r]), int(keys[r + 1])) for r in range(0, rounds, 2)]   # (even, odd) half-rounds

    def __call__(self, position: int) -> int:
        """The window read at ``position`` (an int in [0, n); a numpy integer is taken as a Python int)."""
        if not 0 <= position < self.n:
            raise IndexError(f"position {position} out of range for an order of {self.n} windows")
        n, low_bits, low_mask, high_mask = self.n, self._low_bits, self._low_mask, self._high_mask
        x = int(position)
        while True:
            high, low = x >> low_bits, x & low_mask
            for even, odd in self._keys:
                # M's last product needs no reduction mod 2^64: a half (<= 32 bits) reads its bits 0 .. 62
                z = even ^ high
                z = ((z ^ (z >> 30)) * _MUL1) & _MASK64
                z = (z ^ (z >> 27)) * _MUL2
                low ^= (z ^ (z >> 31)) & low_mask
                z = odd ^ low
                z = ((z ^ (z >> 30)) * _MUL1) & _MASK64
                z = (z ^ (z >> 27)) * _MUL2
                high ^= (z ^ (z >> 31)) & high_mask
            x = (high << low_bits) | low
            if x < n:
                return x

    def windows(self, positions: np.ndarray) -> np.ndarray:
        """The windows read at ``positions`` (any shape, ints in [0, n)), as int64 of that shape: ``self(p)`` for
        every p, in numpy."""
        positions = np.asarray(positions)
        if positions.size and (positions.min() < 0 or positions.max() >= self.n):
            raise IndexError(f"positions outside [0, {self.n})")
        x = self._permute(positions.astype(np.uint64).ravel())
        walking = np.flatnonzero(x >= self.n)
        while walking.size:
            x[walking] = self._permute(x[walking])
            walking = walking[x[walking] >= self.n]
        return x.astype(np.int64).reshape(positions.shape)

    def _permute(self, x: np.ndarray) -> np.ndarray:
        """P (module docstring) of the uint64 array ``x`` [m] of values in [0, 2^b); a new array."""
        low_bits = np.uint64(self._low_bits)
        high, low = x >> low_bits, x & np.uint64(self._low_mask)
        for even, odd in self._keys:
            low ^= _mix(high ^ np.uint64(even)) & np.uint64(self._low_mask)
            high ^= _mix(low ^ np.uint64(odd)) & np.uint64(self._high_mask)
        return (high << low_bits) | low


def _half_rounds(bits: int) -> int:
    """R for a domain of 2^``bits`` (module docstring)."""
    return max(12, 2 * math.ceil(48 / bits))


def _mix(z: np.ndarray) -> np.ndarray:
    """M of the uint64 array ``z`` (module docstring; numpy's uint64 products wrap mod 2^64)."""
    z = (z ^ (z >> np.uint64(30))) * np.uint64(_MUL1)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(_MUL2)
    return z ^ (z >> np.uint64(31))
