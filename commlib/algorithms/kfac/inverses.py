"""Inverting the Kronecker factors and preconditioning a gradient matrix.

Two methods, chosen by ``inverse=``:

``"eigen"`` (default, exact): ``A = Q_A diag(l_A) Q_A^T``, ``G = Q_G diag(l_G) Q_G^T`` and
``(A kron G + damping I)^-1 vec(V) = vec(Q_G [(Q_G^T V Q_A) / (l_G l_A^T + damping)] Q_A^T)``
(``vec`` stacks columns; ``V`` is ``(d_out, d_in)``). Eigenvalues are clamped at 0, which only
removes rounding noise of positive semi-definite factors. Exactly zero rows and columns
(inputs that are always 0) are split off before decomposing, and a float32 decomposition that
does not converge is redone in float64.

``"cholesky"``: ``(A + pi sqrt(damping) I)^-1`` and ``(G + sqrt(damping)/pi I)^-1`` through
Cholesky factorizations, ``pi = sqrt((tr A / d_in) / (tr G / d_out))`` (factored Tikhonov
damping, Martens & Grosse 2015): about 3x cheaper than an eigendecomposition, but only an
approximation of the damped inverse above.

An inverse is a list of tensors (:func:`inverse_shapes`), so that owners can pack them into
one flat buffer and other ranks can view them back out of it.
"""
from __future__ import annotations

import math

import torch

METHODS = ("eigen", "cholesky")


def inverse_shapes(method: str, d_in: int, d_out: int) -> list[tuple[int, ...]]:
    """Shapes of the tensors :func:`compute_inverse` returns, in order."""
    if method == "eigen":
        return [(d_in, d_in), (d_in,), (d_out, d_out), (d_out,)]
    return [(d_in, d_in), (d_out, d_out)]


def inverse_numel(method: str, d_in: int, d_out: int) -> int:
    """Elements of one layer's inverse: ``d_in^2 + d_out^2`` (+ ``d_in + d_out`` eigenvalues)."""
    return sum(math.prod(s) for s in inverse_shapes(method, d_in, d_out))


def compute_inverse(method: str, A: torch.Tensor, G: torch.Tensor,
                    damping: float) -> list[torch.Tensor]:
    """New tensors (``A``: ``(d_in, d_in)``, ``G``: ``(d_out, d_out)``, symmetric PSD, same
    dtype) holding the inverse; ``A`` and ``G`` are not modified. Only the lower triangles
    are read."""
    if method == "eigen":
        l_a, q_a = _eigh(A)
        l_g, q_g = _eigh(G)
        return [q_a, l_a.clamp_(min=0.0), q_g, l_g.clamp_(min=0.0)]
    pi = _pi(A, G)
    root = math.sqrt(damping)
    return [_damped_inverse(A, pi * root), _damped_inverse(G, root / pi)]


def precondition(method: str, inverse: list[torch.Tensor], grad: torch.Tensor,
                 damping: float) -> torch.Tensor:
    """A new ``(d_out, d_in)`` tensor: ``grad`` (same shape, unchanged) preconditioned by
    ``inverse``; ``damping`` must be the value :func:`compute_inverse` was given."""
    if method == "eigen":
        q_a, l_a, q_g, l_g = inverse
        rotated = q_g.T @ grad @ q_a
        rotated.div_(torch.outer(l_g, l_a).add_(damping))
        return q_g @ rotated @ q_a.T
    a_inv, g_inv = inverse
    return g_inv @ grad @ a_inv


def _eigh(M: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Eigenvalues (ascending) and eigenvectors of a symmetric PSD factor.

    Rows and columns that are exactly zero (a zero diagonal entry of a PSD matrix: an input
    that is always 0, such as a patch position that only ever sees padding, or an output
    that never gets a gradient) are split off exactly: their unit vectors are eigenvectors
    with eigenvalue 0, and only the rest is decomposed. Besides saving time, this avoids
    LAPACK failures on such matrices.
    """
    live = torch.diagonal(M) > 0
    if bool(live.all()):
        return _dense_eigh(M)
    d = M.shape[0]
    idx, dead = live.nonzero().squeeze(1), (~live).nonzero().squeeze(1)
    sub_values, sub_vectors = _dense_eigh(M[idx][:, idx])
    values = M.new_zeros(d)
    vectors = M.new_zeros(d, d)
    values[len(dead):] = sub_values
    vectors[dead, torch.arange(len(dead), device=M.device)] = 1.0
    vectors[idx.unsqueeze(1), torch.arange(len(dead), d, device=M.device)] = sub_vectors
    return values, vectors


def _dense_eigh(M: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.linalg.eigh``, retried in float64 (result cast back) when LAPACK does not
    converge, which float32 ``syevd`` can do on matrices with many repeated eigenvalues."""
    try:
        return torch.linalg.eigh(M)
    except torch.linalg.LinAlgError:
        if M.dtype == torch.float64:
            raise
        values, vectors = torch.linalg.eigh(M.double())
        return values.to(M.dtype), vectors.to(M.dtype)


def _pi(A: torch.Tensor, G: torch.Tensor) -> float:
    mean_a = float(torch.diagonal(A).sum()) / A.shape[0]
    mean_g = float(torch.diagonal(G).sum()) / G.shape[0]
    if mean_a <= 0.0 or mean_g <= 0.0:
        return 1.0  # a zero factor (e.g. a layer without gradient): no rebalancing
    return math.sqrt(mean_a / mean_g)


def _damped_inverse(M: torch.Tensor, shift: float) -> torch.Tensor:
    damped = M + shift * torch.eye(M.shape[0], dtype=M.dtype, device=M.device)
    return torch.cholesky_inverse(torch.linalg.cholesky(damped))
