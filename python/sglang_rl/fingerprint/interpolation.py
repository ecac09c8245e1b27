"""Interpolation over GF(65497): the polynomial through a proof's (index, value) points.

Two forms of the same polynomial: the Newton form in numpy (`newton_coefficients`), fastest on
the host, and an expanded Lagrange form in a few dozen batched float64 tensor ops
(`lagrange_coefficients`), exact and free of sequential steps, for accelerators and CUDA graphs.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

PRIME = 65497
"""The field prime of toploc's interpolation, also the first candidate modulus."""


@functools.cache
def inverses() -> torch.Tensor:
    """Table of modular inverses mod PRIME (entry 0 is 0), built once by Fermat's little theorem."""
    base = torch.arange(PRIME, dtype=torch.int64)
    result = torch.ones_like(base)
    exponent = PRIME - 2
    while exponent:
        if exponent & 1:
            result = result * base % PRIME
        base = base * base % PRIME
        exponent >>= 1
    return result


@functools.cache  # kept for good: a captured CUDA graph reads it
def _device_inverses(device: torch.device) -> torch.Tensor:
    """`inverses` on `device` as float64, copied there once."""
    return inverses().to(device=device, dtype=torch.float64)


def newton_coefficients(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Ascending coefficients of the interpolating polynomial mod PRIME, one row per proof.

    ``x`` [B, k] holds distinct values in 0..PRIME-1 per row, ``y`` [B, k] values in 0..PRIME-1.
    Newton divided differences, then Horner-style expansion of the Newton form in place: the
    polynomial of degree d lives in columns k-1-d.. and each step multiplies it by (t - x_i).
    Every intermediate stays below PRIME**2 + PRIME < 2**33 in magnitude, far inside int64.
    The 2k sequential steps run in numpy: each is a few tiny array ops, where numpy's per-op cost
    is a fraction of torch's (3-4x faster in all; this runs beside the scheduler loop).
    """
    inverse = inverses().numpy()
    xs = x.numpy()
    dd = y.numpy().copy()
    k = xs.shape[1]
    for step in range(1, k):
        numerator = dd[:, step:] - dd[:, step - 1 : -1]
        denominator = (xs[:, step:] - xs[:, : k - step]) % PRIME
        dd[:, step:] = numerator * inverse[denominator] % PRIME
    coeffs = np.zeros_like(dd)
    coeffs[:, k - 1] = dd[:, k - 1]
    for i in range(k - 2, -1, -1):
        coeffs[:, i : k - 1] -= xs[:, i : i + 1] * coeffs[:, i + 1 :]
        coeffs[:, i] += dd[:, i]
        coeffs[:, i:] %= PRIME
    return torch.from_numpy(coeffs)


@functools.lru_cache(maxsize=64)
def _toeplitz_index(length: int, device: torch.device) -> torch.Tensor:
    """[2L-1, L] gather index of the product matrix T[s, t] = a[s - t] (index L: a zero pad)."""
    shift = torch.arange(2 * length - 1, device=device)[:, None] - torch.arange(length, device=device)[None, :]
    return torch.where((shift >= 0) & (shift < length), shift, length)


@functools.lru_cache(maxsize=16)
def _hankel_index(k: int, device: torch.device) -> torch.Tensor:
    """[k, k] gather index H[j, e] = j + 1 + e, clamped to 2k (a zero pad)."""
    return (torch.arange(k, device=device)[:, None] + 1 + torch.arange(k, device=device)[None, :]).clamp(max=2 * k)


def _product_tree(roots: torch.Tensor) -> torch.Tensor:
    """Ascending coefficients [B, k+1] of prod_i (t - roots[:, i]) mod PRIME, multiplied pairwise
    in log2(k) rounds; each round's products are one batched matmul of Toeplitz matrices.
    ``roots`` is float64 with integer values in 0..PRIME-1."""
    batch, k = roots.shape
    width = 1 << max(0, (k - 1).bit_length())
    polys = torch.zeros(batch, width, 2, dtype=torch.float64, device=roots.device)
    polys[:, :, 0] = 1.0  # padding factors are the constant 1
    polys[:, :k, 0] = torch.fmod(PRIME - roots, PRIME)
    polys[:, :k, 1] = 1.0
    while polys.shape[1] > 1:
        left, right = polys[:, 0::2], polys[:, 1::2]
        pairs, length = left.shape[1], left.shape[2]
        padded = torch.cat([left, left.new_zeros(batch, pairs, 1)], dim=2)
        toeplitz = padded[:, :, _toeplitz_index(length, roots.device)]
        polys = torch.fmod(torch.matmul(toeplitz, right.unsqueeze(-1)).squeeze(-1), PRIME)
    return polys[:, 0, : k + 1]


def lagrange_coefficients(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The same polynomial as ``newton_coefficients``, in O(log k) batched tensor ops on the
    inputs' device, for the GPU, where the Newton form's 2k sequential steps would each be a
    kernel launch.

    With M(t) = prod (t - x_i) and w_i = y_i / M'(x_i), the coefficients are
    c_j = sum_{m > j} M_m * A_{m-j-1} with A_e = sum_i w_i x_i^e (Lagrange's form, expanded).
    The sums run as float64 matmuls: every operand is an integer below PRIME and every partial
    sum stays below k * PRIME**2 < 2**53, so they are exact; reductions use fmod, which is exact.
    """
    device = x.device
    xs = x.to(torch.float64)
    ys = y.to(torch.float64)
    batch, k = xs.shape
    master = _product_tree(xs)
    powers = torch.empty(batch, k, k, dtype=torch.float64, device=device)
    powers[:, :, 0] = 1.0
    filled, x_to_filled = 1, xs
    while filled < k:  # x^(filled + e) = x^e * x^filled: doubling, log2(k) steps
        step = min(filled, k - filled)
        powers[:, :, filled : filled + step] = torch.fmod(powers[:, :, :step] * x_to_filled.unsqueeze(-1), PRIME)
        x_to_filled = torch.fmod(x_to_filled * x_to_filled, PRIME)
        filled += step
    degrees = torch.arange(1, k + 1, dtype=torch.float64, device=device)
    derivative = torch.fmod(master[:, 1:] * degrees, PRIME)
    at_roots = torch.fmod(torch.bmm(powers, derivative.unsqueeze(-1)).squeeze(-1), PRIME)
    inverse = _device_inverses(device)
    weights = torch.fmod(ys * inverse[at_roots.to(torch.int64)], PRIME)
    moments = torch.fmod(torch.bmm(weights.unsqueeze(1), powers).squeeze(1), PRIME)
    padded = torch.cat([master, master.new_zeros(batch, k)], dim=1)
    coeffs = torch.fmod(torch.bmm(padded[:, _hankel_index(k, device)], moments.unsqueeze(-1)).squeeze(-1), PRIME)
    return coeffs.to(torch.int64)
