"""Colours of Gaussians seen from cameras: spherical harmonics, with the coefficients' gradient kept factored.

``sh_colors(means, coeffs, campos, degree) -> [C, N, 3]`` is what gsplat computes inside its
``rasterization`` before drawing: the SH value along ``means - camera centre``, plus 0.5,
clamped at 0. The gradient of the coefficients ``[N, K, 3]`` is rank one per camera and
Gaussian: ``dL/dcoeffs[n, k, ch] = sum_c basis[c, n, k] * v_sh[c, n, ch]``, the SH basis
times the gradient of the colour. gsplat writes it out in full (``K * 3`` floats per Gaussian,
zeros included, 1.2 ms for 4M Gaussians on an H200); here, inside a
:func:`deferred_sh_gradients` block, the backward pass keeps the two factors instead
(``(K + 3) * C`` floats per Gaussian) and hands them to whoever takes them
(:meth:`DeferredGradients.pop`; :class:`insitu.training.adam.ShardAdam` forms the gradient inside its
update, where it reads the coefficients anyway). Outside such a block the gradient is written
to ``coeffs.grad`` as usual. The means' gradient (through the view direction) is computed
either way.

On CUDA the forward and backward passes are Triton kernels (one program per block of
Gaussians, every camera in turn); elsewhere the same functions are torch operations, which are
the kernels' oracle in the tests.
"""
from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

try:                                    # Triton ships with CUDA builds of torch
    import triton
    import triton.language as tl
except ImportError:                     # pragma: no cover - CPU-only installs
    triton = None

MAX_SH_DEGREE = 3

# Real spherical-harmonic basis constants, in the order of the reference 3DGS code and gsplat.
SH_C0 = 0.28209479177387814
SH_C1 = 0.4886025119029199
SH_C2 = (1.0925484305920792, -1.0925484305920792, 0.31539156525252005, -1.0925484305920792, 0.5462742152960396)
SH_C3 = (-0.5900435899266435, 2.890611442640554, -0.4570457994644658, 0.3731763325901154,
         -0.4570457994644658, 1.445305721320277, -0.5900435899266435)


def sh_basis(degree: int, dirs: Tensor) -> Tensor:
    """The real SH basis of bands ``0..degree`` along ``dirs: [..., 3]`` (normalised here) ->
    ``[..., (degree + 1) ** 2]`` (gsplat's order and signs)."""
    bases = [torch.full_like(dirs[..., 0], SH_C0)]
    if degree >= 1:
        x, y, z = F.normalize(dirs, dim=-1).unbind(-1)
        bases += [-SH_C1 * y, SH_C1 * z, -SH_C1 * x]
        if degree >= 2:
            xx, yy, zz, xy, yz, xz = x * x, y * y, z * z, x * y, y * z, x * z
            bases += [SH_C2[0] * xy, SH_C2[1] * yz, SH_C2[2] * (2 * zz - xx - yy),
                      SH_C2[3] * xz, SH_C2[4] * (xx - yy)]
            if degree >= 3:
                bases += [SH_C3[0] * y * (3 * xx - yy), SH_C3[1] * xy * z,
                          SH_C3[2] * y * (4 * zz - xx - yy), SH_C3[3] * z * (2 * zz - 3 * xx - 3 * yy),
                          SH_C3[4] * x * (4 * zz - xx - yy), SH_C3[5] * z * (xx - yy),
                          SH_C3[6] * x * (xx - 3 * yy)]
    return torch.stack(bases, dim=-1)


@dataclass
class DeferredGradients:
    """The factored coefficient gradients of a :func:`deferred_sh_gradients` block, per coefficient tensor.

    ``factors[i] = (coeffs, basis [C, N, Kd], v_sh [C, N, 3])``: one entry per backward pass through
    :func:`sh_colors` (``Kd = (degree + 1) ** 2``; the bands above it have no gradient).
    """

    factors: list[tuple[Tensor, Tensor, Tensor]] = field(default_factory=list)

    def pop(self, coeffs: Tensor) -> tuple[Tensor, Tensor] | None:
        """The factors ``(basis [C', N, Kd], v_sh [C', N, 3])`` of ``coeffs``' gradient (the entries of
        several passes joined along the cameras), removed from here; None when there are none."""
        mine = [f for f in self.factors if f[0] is coeffs]
        if not mine:
            return None
        self.factors = [f for f in self.factors if f[0] is not coeffs]
        if len(mine) == 1:
            return mine[0][1], mine[0][2]
        kd = max(b.shape[-1] for _, b, _ in mine)
        basis = torch.cat([F.pad(b, (0, kd - b.shape[-1])) for _, b, _ in mine])
        return basis, torch.cat([v for _, _, v in mine])

    def accumulate(self, coeffs: Tensor) -> None:
        """Add ``coeffs``' pending gradient to ``coeffs.grad`` (written out in full), as autograd would have."""
        f = self.pop(coeffs)
        if f is not None:
            g = dense_gradient(*f, coeffs.shape[1])
            coeffs.grad = g if coeffs.grad is None else coeffs.grad + g


_DEFERRED: contextvars.ContextVar[DeferredGradients | None] = contextvars.ContextVar("sh_deferred", default=None)


@contextlib.contextmanager
def deferred_sh_gradients():
    """Within this block, :func:`sh_colors` leaves its coefficients' gradient factored in the
    :class:`DeferredGradients` it yields (the backward pass may run after the block)."""
    sink = DeferredGradients()
    token = _DEFERRED.set(sink)
    try:
        yield sink
    finally:
        _DEFERRED.reset(token)


def dense_gradient(basis: Tensor, v_sh: Tensor, K: int) -> Tensor:
    """``[N, K, 3]`` the coefficients' gradient from its factors ``basis: [C, N, Kd]``, ``v_sh: [C, N, 3]``."""
    g = torch.einsum("cnk,cnd->nkd", basis, v_sh)
    return F.pad(g, (0, 0, 0, K - g.shape[1]))


def sh_colors(means: Tensor, coeffs: Tensor, campos: Tensor, degree: int) -> Tensor:
    """Colours ``[C, N, 3]``: ``max(SH_degree(means - campos) . coeffs + 0.5, 0)`` for every camera.

    Args:
        means: [N, 3] Gaussian centres (world).
        coeffs: [N, K, 3] SH coefficients, ``K >= (degree + 1) ** 2``; bands above ``degree`` unused.
        campos: [C, 3] camera centres (world); no gradient flows to them.
        degree: SH degree, 0..3.

    Differentiable in ``means`` and ``coeffs`` (the latter's gradient deferred inside
    :func:`deferred_sh_gradients`).
    """
    if not 0 <= degree <= MAX_SH_DEGREE:
        raise ValueError(f"sh_colors: expected a degree in 0..{MAX_SH_DEGREE}, got {degree}")
    if means.ndim != 2 or means.shape[1] != 3:
        raise ValueError(f"sh_colors: means: expected [N, 3], got {tuple(means.shape)}")
    N = means.shape[0]
    if coeffs.ndim != 3 or coeffs.shape[0] != N or coeffs.shape[2] != 3 or coeffs.shape[1] < (degree + 1) ** 2:
        raise ValueError(f"sh_colors: coeffs: expected [{N}, K >= {(degree + 1) ** 2}, 3], got {tuple(coeffs.shape)}")
    if campos.ndim != 2 or campos.shape[1] != 3:
        raise ValueError(f"sh_colors: campos: expected [C, 3], got {tuple(campos.shape)}")
    return _SHColors.apply(means, coeffs, campos.detach(), int(degree), _DEFERRED.get())


class _SHColors(torch.autograd.Function):
    @staticmethod
    def forward(ctx, means, coeffs, campos, degree, sink):
        ctx.save_for_backward(means, coeffs, campos)
        # only a leaf's gradient is deferred: one computed from the parameter (a copy, a view) must reach it
        ctx.degree, ctx.sink, ctx.saved = degree, sink if coeffs.is_leaf else None, None
        if _use_triton(means):
            out, ctx.saved = _forward_triton(means, coeffs, campos, degree,
                                             save=ctx.needs_input_grad[0] or ctx.needs_input_grad[1])
            return out
        return _forward_torch(means, coeffs, campos, degree)

    @staticmethod
    def backward(ctx, v_colors):
        means, coeffs, campos = ctx.saved_tensors
        if ctx.saved is not None:
            basis, v_sh, v_means = _backward_triton(means, campos, v_colors.contiguous(), *ctx.saved)
        else:
            basis, v_sh, v_means = _backward_torch(means, coeffs, campos, ctx.degree, v_colors)
        v_coeffs = None
        if ctx.needs_input_grad[1]:
            if ctx.sink is not None:
                ctx.sink.factors.append((coeffs, basis, v_sh))
            else:
                v_coeffs = dense_gradient(basis, v_sh, coeffs.shape[1])
        return (v_means if ctx.needs_input_grad[0] else None), v_coeffs, None, None, None


def _use_triton(t: Tensor) -> bool:
    return triton is not None and t.is_cuda and t.dtype == torch.float32


def _forward_torch(means, coeffs, campos, degree):
    dirs = means[None] - campos[:, None]                                         # [C, N, 3]
    basis = sh_basis(degree, dirs)                                               # [C, N, Kd]
    raw = torch.einsum("cnk,nkd->cnd", basis, coeffs[:, :basis.shape[-1]])
    return torch.clamp_min(raw + 0.5, 0.0)


def _backward_torch(means, coeffs, campos, degree, v_colors):
    """``(basis [C, N, Kd], v_sh [C, N, 3], v_means [N, 3])`` by autograd through the basis."""
    with torch.enable_grad():
        dirs = (means.detach()[None] - campos[:, None]).requires_grad_()
        basis = sh_basis(degree, dirs)
        kd = basis.shape[-1]
        c = coeffs.detach()[:, :kd]
        raw = torch.einsum("cnk,nkd->cnd", basis.detach(), c)
        v_sh = v_colors * (raw + 0.5 >= 0)                                       # clamp_min's gradient
        w = torch.einsum("cnd,nkd->cnk", v_sh, c)
        (v_dirs,) = torch.autograd.grad(basis, dirs, w) if degree > 0 else (torch.zeros_like(dirs),)
    return basis.detach(), v_sh, v_dirs.sum(0)


_BLOCK, _WARPS = 32, 4          # Gaussians per program: the fastest of bench_shading.py


def _forward_triton(means, coeffs, campos, degree, *, save):
    """Colours ``[C, N, 3]``, and with ``save`` what backward needs: ``(basis [C, N, Kd], shifted
    [C, 3, N]`` (SH + 0.5, before the clamp), ``dmat [C, 9, N]`` (the colours' derivatives in the
    unit direction's components, per channel))."""
    C, N, K = campos.shape[0], means.shape[0], coeffs.shape[1]
    kd = (degree + 1) ** 2
    out = means.new_empty(C, N, 3)
    saved = (means.new_empty(C, N, kd), means.new_empty(C, 3, N), means.new_empty(C, 9, N)) if save else None
    if N:
        basis, shifted, dmat = saved if save else (out, out, out)
        _sh_forward[(triton.cdiv(N, _BLOCK),)](means.contiguous(), coeffs.contiguous(), campos.contiguous(), out,
                                              basis, shifted, dmat, N, C, kd, K=K, SAVE=save, BLOCK=_BLOCK,
                                              num_warps=_WARPS)
    return out, saved


def _backward_triton(means, campos, v_colors, basis, shifted, dmat):
    C, N = campos.shape[0], means.shape[0]
    v_sh, v_means = means.new_empty(C, N, 3), means.new_empty(N, 3)
    if N:
        _sh_backward[(triton.cdiv(N, _BLOCK),)](means.contiguous(), campos.contiguous(), v_colors, shifted, dmat,
                                               v_sh, v_means, N, C, BLOCK=_BLOCK, num_warps=_WARPS)
    return basis, v_sh, v_means


if triton is not None:
    @triton.jit
    def _term(k: tl.constexpr, x, y, z):
        """Basis function ``k`` at the unit direction (x, y, z) and its partial derivatives in x, y, z
        (the direction's components taken as independent; the caller projects onto the sphere). The
        numbers are SH_C0..SH_C3 above, written out: Triton's interpreter does not multiply a global
        ``tl.constexpr`` by a tensor; the GPU tests check the kernels against ``sh_basis`` and gsplat."""
        zero = 0.0 * x
        if k == 0:
            return zero + 0.28209479177387814, zero, zero, zero
        elif k == 1:
            return -0.4886025119029199 * y, zero, zero - 0.4886025119029199, zero
        elif k == 2:
            return 0.4886025119029199 * z, zero, zero, zero + 0.4886025119029199
        elif k == 3:
            return -0.4886025119029199 * x, zero - 0.4886025119029199, zero, zero
        elif k == 4:
            c = 1.0925484305920792
            return c * x * y, c * y, c * x, zero
        elif k == 5:
            c = -1.0925484305920792
            return c * y * z, zero, c * z, c * y
        elif k == 6:
            c = 0.31539156525252005
            return c * (2.0 * z * z - x * x - y * y), -2.0 * c * x, -2.0 * c * y, 4.0 * c * z
        elif k == 7:
            c = -1.0925484305920792
            return c * x * z, c * z, zero, c * x
        elif k == 8:
            c = 0.5462742152960396
            return c * (x * x - y * y), 2.0 * c * x, -2.0 * c * y, zero
        elif k == 9:
            c = -0.5900435899266435
            return c * y * (3.0 * x * x - y * y), 6.0 * c * x * y, c * (3.0 * x * x - 3.0 * y * y), zero
        elif k == 10:
            c = 2.890611442640554
            return c * x * y * z, c * y * z, c * x * z, c * x * y
        elif k == 11:
            c = -0.4570457994644658
            return (c * y * (4.0 * z * z - x * x - y * y), -2.0 * c * x * y,
                    c * (4.0 * z * z - x * x - 3.0 * y * y), 8.0 * c * y * z)
        elif k == 12:
            c = 0.3731763325901154
            return (c * z * (2.0 * z * z - 3.0 * x * x - 3.0 * y * y), -6.0 * c * x * z, -6.0 * c * y * z,
                    c * (6.0 * z * z - 3.0 * x * x - 3.0 * y * y))
        elif k == 13:
            c = -0.4570457994644658
            return (c * x * (4.0 * z * z - x * x - y * y), c * (4.0 * z * z - 3.0 * x * x - y * y),
                    -2.0 * c * x * y, 8.0 * c * x * z)
        elif k == 14:
            c = 1.445305721320277
            return c * z * (x * x - y * y), 2.0 * c * x * z, -2.0 * c * y * z, c * (x * x - y * y)
        else:
            c = -0.5900435899266435
            return c * x * (x * x - 3.0 * y * y), c * (3.0 * x * x - 3.0 * y * y), -6.0 * c * x * y, zero

    @triton.jit
    def _direction(means_ptr, campos_ptr, n, mask, c):
        """The unit direction from camera ``c`` to Gaussians ``n`` (int64) and 1 / its length."""
        dx = tl.load(means_ptr + n * 3, mask=mask, other=1.0) - tl.load(campos_ptr + c * 3)
        dy = tl.load(means_ptr + n * 3 + 1, mask=mask, other=0.0) - tl.load(campos_ptr + c * 3 + 1)
        dz = tl.load(means_ptr + n * 3 + 2, mask=mask, other=0.0) - tl.load(campos_ptr + c * 3 + 2)
        r = tl.sqrt(dx * dx + dy * dy + dz * dz)
        inv = 1.0 / tl.maximum(r, 1e-12)                # F.normalize's eps
        return dx * inv, dy * inv, dz * inv, inv

    @triton.jit(do_not_specialize=["N", "C", "KD"])
    def _sh_forward(means_ptr, coeffs_ptr, campos_ptr, out_ptr, basis_ptr, shifted_ptr, dmat_ptr, N, C, KD,
                    K: tl.constexpr, SAVE: tl.constexpr, BLOCK: tl.constexpr):
        """The colours of this program's Gaussians in every camera, from the first ``KD`` basis functions
        (a run-time value: one compiled kernel serves every degree). The coefficients are read once,
        as a ``[BLOCK, 16, 4]`` tile (bands x channels, coalesced); per camera the basis and its
        derivatives are ``[BLOCK, 16]`` tiles, and the colour and its derivatives their contractions
        with the coefficients."""
        KP: tl.constexpr = 16
        n = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = n < N
        kk = tl.arange(0, KP)[None, :]                                   # [1, KP]
        ch = tl.arange(0, 4)[None, :]                                    # [1, 4]
        tmask = mask[:, None, None] & (kk[:, :, None] < KD) & (ch[:, None, :] < 3)
        coeffs = tl.load(coeffs_ptr + n[:, None, None] * (K * 3) + kk[:, :, None] * 3 + ch[:, None, :],
                         mask=tmask, other=0.0)                          # [BLOCK, KP, 4]
        cmask = mask[:, None] & (ch < 3)
        stride = n * 0 + N                                               # N, in int64
        for c in range(C):
            x, y, z, _ = _direction(means_ptr, campos_ptr, n, mask, c)
            b = tl.zeros([BLOCK, KP], dtype=tl.float32)
            bx = tl.zeros([BLOCK, KP], dtype=tl.float32)
            by = tl.zeros([BLOCK, KP], dtype=tl.float32)
            bz = tl.zeros([BLOCK, KP], dtype=tl.float32)
            for k in tl.static_range(KP):                               # the coefficients above KD are 0
                t, tx, ty, tz = _term(k, x, y, z)
                b = tl.where(kk == k, t[:, None], b)
                if SAVE:
                    bx = tl.where(kk == k, tx[:, None], bx)
                    by = tl.where(kk == k, ty[:, None], by)
                    bz = tl.where(kk == k, tz[:, None], bz)
            shifted = tl.sum(coeffs * b[:, :, None], axis=1) + 0.5      # [BLOCK, 4]
            cn = n + c * stride
            tl.store(out_ptr + cn[:, None] * 3 + ch, tl.maximum(shifted, 0.0), mask=cmask)
            if SAVE:
                tl.store(basis_ptr + cn[:, None] * KD + kk, b, mask=mask[:, None] & (kk < KD))
                plane = n[:, None] + (c * 3 + ch) * stride[:, None]      # [C, 3, N] and [C, 9, N]: planar
                tl.store(shifted_ptr + plane, shifted, mask=cmask)
                d = n[:, None] + (c * 9 + ch) * stride[:, None]
                tl.store(dmat_ptr + d, tl.sum(coeffs * bx[:, :, None], axis=1), mask=cmask)
                tl.store(dmat_ptr + d + 3 * stride[:, None], tl.sum(coeffs * by[:, :, None], axis=1), mask=cmask)
                tl.store(dmat_ptr + d + 6 * stride[:, None], tl.sum(coeffs * bz[:, :, None], axis=1), mask=cmask)

    @triton.jit(do_not_specialize=["N", "C"])
    def _sh_backward(means_ptr, campos_ptr, vcol_ptr, shifted_ptr, dmat_ptr, vsh_ptr, vmeans_ptr, N, C,
                     BLOCK: tl.constexpr):
        """Per camera: the colour's gradient through the clamp (stored, for the coefficients), and the
        direction's gradient from the saved derivatives, summed over the cameras into the means'."""
        n = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = n < N
        gx = tl.zeros([BLOCK], dtype=tl.float32)
        gy = tl.zeros([BLOCK], dtype=tl.float32)
        gz = tl.zeros([BLOCK], dtype=tl.float32)
        stride = n * 0 + N                                  # N, in int64
        for c in range(C):
            cn = n + c * stride
            p = n + (c * 3) * stride
            vr = tl.load(vcol_ptr + cn * 3, mask=mask, other=0.0)
            vg = tl.load(vcol_ptr + cn * 3 + 1, mask=mask, other=0.0)
            vb = tl.load(vcol_ptr + cn * 3 + 2, mask=mask, other=0.0)
            vr = tl.where(tl.load(shifted_ptr + p, mask=mask, other=0.0) >= 0.0, vr, 0.0)
            vg = tl.where(tl.load(shifted_ptr + p + stride, mask=mask, other=0.0) >= 0.0, vg, 0.0)
            vb = tl.where(tl.load(shifted_ptr + p + 2 * stride, mask=mask, other=0.0) >= 0.0, vb, 0.0)
            tl.store(vsh_ptr + cn * 3, vr, mask=mask)
            tl.store(vsh_ptr + cn * 3 + 1, vg, mask=mask)
            tl.store(vsh_ptr + cn * 3 + 2, vb, mask=mask)
            x, y, z, inv = _direction(means_ptr, campos_ptr, n, mask, c)
            d = dmat_ptr + n + (c * 9) * stride
            ux = (vr * tl.load(d, mask=mask, other=0.0) + vg * tl.load(d + stride, mask=mask, other=0.0)
                  + vb * tl.load(d + 2 * stride, mask=mask, other=0.0))
            uy = (vr * tl.load(d + 3 * stride, mask=mask, other=0.0)
                  + vg * tl.load(d + 4 * stride, mask=mask, other=0.0)
                  + vb * tl.load(d + 5 * stride, mask=mask, other=0.0))
            uz = (vr * tl.load(d + 6 * stride, mask=mask, other=0.0)
                  + vg * tl.load(d + 7 * stride, mask=mask, other=0.0)
                  + vb * tl.load(d + 8 * stride, mask=mask, other=0.0))
            dot = ux * x + uy * y + uz * z              # onto the sphere: (I - d d^T) / |dir|
            gx += (ux - dot * x) * inv
            gy += (uy - dot * y) * inv
            gz += (uz - dot * z) * inv
        tl.store(vmeans_ptr + n * 3, gx, mask=mask)
        tl.store(vmeans_ptr + n * 3 + 1, gy, mask=mask)
        tl.store(vmeans_ptr + n * 3 + 2, gz, mask=mask)
