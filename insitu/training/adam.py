"""Adam over a shard's parameters in one pass: one kernel launch per step on CUDA.

A training step updates five parameters (means, scales, quats, opacities, SH colours). Five
``torch.optim.Adam`` instances cost five launches and five passes of Python bookkeeping per
step, which at small images is as long as the kernels themselves, and constructing the first
one imports ``torch._dynamo`` (seconds, once per process). :class:`ShardAdam` gives each
parameter the update of ``torch.optim.Adam`` (same moments, bias corrections and ``eps``
outside the square root) at its own learning rate, in one Triton kernel on CUDA and with torch
operations elsewhere. ``colors: [N, K, 3]`` (SH band 0, then the others) has two rates: ``lr``
for band 0, ``lr_rest`` for the rest.

gsplat's densification ops (``gsplat.strategy.ops``) take a dict of optimizers and use, of
each, ``param_groups[0]["params"]`` and ``state[param]``; :attr:`ShardAdam.views` is that dict,
one :class:`ParamState` per parameter, so the ops replace a parameter and its moments in place
and the next step uses the new ones.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

from insitu.render.shading import DeferredGradients, dense_gradient

try:                                    # Triton ships with CUDA builds of torch
    import triton
    import triton.language as tl
except ImportError:                     # pragma: no cover - CPU-only installs
    triton = None


class ParamState:
    """What gsplat's ops use of an optimizer, for one parameter: ``param_groups`` (one group:
    ``params``, ``lr``, and ``lr_rest``, the rate of SH bands >= 1 of ``[N, K, 3]`` colours, or None)
    and ``state[param]`` (``step``, ``exp_avg``, ``exp_avg_sq``)."""

    def __init__(self, param: Tensor, lr: float, lr_rest: float | None = None) -> None:
        if lr_rest is not None and (param.ndim != 3 or param.shape[-1] != 3):
            raise ValueError(f"lr_rest: expected SH coefficients [N, K, 3] for it, got shape {tuple(param.shape)}")
        rest = None if lr_rest is None else float(lr_rest)
        self.param_groups = [{"params": [param], "lr": float(lr), "lr_rest": rest}]
        self.state = {param: {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(param),
                              "exp_avg_sq": torch.zeros_like(param)}}

    @property
    def param(self) -> Tensor:
        return self.param_groups[0]["params"][0]

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.param.grad = None


class ShardAdam:
    """Adam over named parameters, each at its own learning rate, one pass per :meth:`step`.

    params:  ``{name: Parameter}``; every parameter's first dimension is the Gaussians.
    lrs:     ``{name: lr}``, or ``{name: (lr, lr_rest)}`` for ``colors: [N, K, 3]`` (band 0 at
             ``lr``, bands >= 1 at ``lr_rest``).
    betas, eps: as ``torch.optim.Adam``.

    ``views[name]`` is the parameter's :class:`ParamState` (its learning rate is
    ``views[name].param_groups[0]["lr"]``, which a schedule may change between steps). A
    parameter without a gradient is left alone in that step; the step count is shared.
    """

    def __init__(self, params: dict[str, Tensor], lrs: dict[str, float | tuple[float, float]], *,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8) -> None:
        if set(params) != set(lrs):
            raise ValueError(f"lrs: expected a learning rate for each of {sorted(params)}, got {sorted(lrs)}")
        self.betas, self.eps = (float(betas[0]), float(betas[1])), float(eps)
        self.views = {k: ParamState(p, *(lrs[k] if isinstance(lrs[k], tuple) else (lrs[k],)))
                      for k, p in params.items()}
        self.steps = 0

    @torch.no_grad()
    def step(self, deferred: DeferredGradients | None = None) -> None:
        """One Adam update of every parameter that has a gradient.

        deferred: SH coefficient gradients left factored by :func:`insitu.render.shading.deferred_sh_gradients`
                  (``basis [C, N, Kd]`` times ``v_sh [C, N, 3]`` per camera); a parameter's factors are
                  taken from it and its gradient formed inside the update (added to ``.grad`` if both).
        """
        factors = {}
        for name, v in self.views.items():
            f = None if deferred is None else deferred.pop(v.param)
            if f is not None:
                (C, G, KD), p = f[0].shape, v.param
                if p.ndim != 3 or p.shape[2] != 3 or G != p.shape[0] or KD > p.shape[1] or f[1].shape != (C, G, 3):
                    raise ValueError(f"ShardAdam: {name}: expected the factors of [N, K, 3] coefficients, basis "
                                     f"[C, N, <= K] and v_sh [C, N, 3], got {tuple(p.shape)}, {tuple(f[0].shape)}, "
                                     f"{tuple(f[1].shape)}")
                factors[name] = f
        live = [(v, factors.get(k)) for k, v in self.views.items()
                if (v.param.grad is not None or k in factors) and v.param.numel() > 0]
        if not live:
            return
        self.steps += 1
        b1, b2 = self.betas
        bc1, bc2_sqrt = 1 - b1 ** self.steps, math.sqrt(1 - b2 ** self.steps)
        for v, _ in live:
            v.state[v.param]["step"].fill_(self.steps)
        triton_ok = live[0][0].param.is_cuda and triton is not None and len(live) <= _SEGMENTS
        for i, (v, f) in enumerate(live):       # the kernel forms one factored gradient; any other is written out
            if f is not None and (not triton_ok or v.param.grad is not None
                                  or any(g is not None for _, g in live[:i])):
                g = dense_gradient(*f, v.param.shape[1])
                v.param.grad = g if v.param.grad is None else v.param.grad + g
                live[i] = (v, None)
        if triton_ok:
            _step_triton(live, bc1, bc2_sqrt, b1, b2, self.eps)
            return
        for v, _ in live:
            p, state, group = v.param, v.state[v.param], v.param_groups[0]
            m, s, g = state["exp_avg"], state["exp_avg_sq"], p.grad
            m.lerp_(g, 1 - b1)
            s.mul_(b2).addcmul_(g, g, value=1 - b2)
            denom = (s.sqrt() / bc2_sqrt).add_(self.eps)
            if group["lr_rest"] is None:
                p.addcdiv_(m, denom, value=-group["lr"] / bc1)
            else:
                p[:, :1].addcdiv_(m[:, :1], denom[:, :1], value=-group["lr"] / bc1)
                p[:, 1:].addcdiv_(m[:, 1:], denom[:, 1:], value=-group["lr_rest"] / bc1)

    def zero_grad(self) -> None:
        for v in self.views.values():
            v.zero_grad()


_SEGMENTS, _BLOCK, _WARPS = 5, 1024, 4      # the fastest of bench_adam.py


def _step_triton(live: list[tuple[ParamState, tuple[Tensor, Tensor] | None]], bc1: float, bc2_sqrt: float,
                 b1: float, b2: float, eps: float) -> None:
    """One launch over up to five parameters: program ``i`` updates a block of the parameter whose
    block range holds ``i`` (unused segments get no blocks). At most one parameter comes with
    factors ``(basis [C, N, Kd], v_sh [C, N, 3])`` instead of a gradient."""
    segments, starts, rows, facts, total = [], [], [], [], 0
    dummy = live[0][0].param
    basis = v_sh = dummy
    C = G = KD = 0
    for v, f in live:
        p, state, group = v.param, v.state[v.param], v.param_groups[0]
        m, s = state["exp_avg"], state["exp_avg_sq"]
        if not (p.is_contiguous() and m.is_contiguous() and s.is_contiguous()):
            raise ValueError("ShardAdam: parameters and their moments must be contiguous")
        rest = group["lr_rest"]
        if f is not None:
            basis, v_sh = f[0].contiguous(), f[1].contiguous()
            C, G, KD = basis.shape
        segments += [p, dummy if f is not None else p.grad.contiguous(), m, s, p.numel(), group["lr"] / bc1,
                     (group["lr"] if rest is None else rest) / bc1]
        # rows whose first 3 (SH band 0) take lr; a factored gradient needs its rows (Gaussians) too
        rows.append(p[0].numel() if rest is not None or f is not None else 0)
        facts.append(f is not None)
        starts.append(total)
        total += triton.cdiv(p.numel(), _BLOCK)
    for _ in range(_SEGMENTS - len(live)):
        segments += [dummy, dummy, dummy, dummy, 0, 0.0, 0.0]
        rows.append(0)
        facts.append(False)
        starts.append(total)
    _adam_kernel[(total,)](*segments, *starts[1:], b1, b2, eps, bc2_sqrt, basis, v_sh, C, G, max(KD, 1), *rows,
                           *facts, BLOCK=_BLOCK, num_warps=_WARPS)


if triton is not None:
    @triton.jit
    def _adam_block(p_ptr, g_ptr, m_ptr, v_ptr, n, step0, step_rest, block, b1, b2, eps, bc2_sqrt,
                    basis_ptr, vsh_ptr, C, G, KD, ROW: tl.constexpr, FACT: tl.constexpr, BLOCK: tl.constexpr):
        """Block ``block`` of one parameter (``n`` elements); ``ROW`` > 0: rows of ``ROW`` elements
        whose first 3 take ``step0`` and the others ``step_rest`` (0: all ``step0``). ``FACT``: the
        gradient of element ``(row, k, ch)`` is ``sum_c basis[c, row, k] * vsh[c, row, ch]`` (``C``
        cameras, ``G`` rows, ``k < KD``; 0 above), not read from ``g_ptr``."""
        start = block.to(tl.int64) * BLOCK
        offs = start + tl.arange(0, BLOCK)
        full = start + BLOCK <= n                   # all but the last block: no mask, wide loads
        mask = offs < n
        if FACT:                                    # rows from r0 on: 32-bit offsets from row r0
            r0 = start // ROW
            local = (start - r0 * ROW).to(tl.int32) + tl.arange(0, BLOCK)
            row = local // ROW
            j = local - row * ROW
            k = j // 3
            kmask = mask & (k < KD)
            g = tl.zeros([BLOCK], dtype=tl.float32)
            for c in range(C):
                first = r0 + G.to(tl.int64) * c         # camera c's row r0
                g += (tl.load(basis_ptr + first * KD + row * KD + k, mask=kmask, other=0.0)
                      * tl.load(vsh_ptr + first * 3 + row * 3 + (j - 3 * k), mask=mask, other=0.0))
        elif full:
            g = tl.load(g_ptr + offs)
        else:
            g = tl.load(g_ptr + offs, mask=mask, other=0.0)
        if full:
            m = tl.load(m_ptr + offs)
            v = tl.load(v_ptr + offs)
            p = tl.load(p_ptr + offs)
        else:
            m = tl.load(m_ptr + offs, mask=mask, other=0.0)
            v = tl.load(v_ptr + offs, mask=mask, other=0.0)
            p = tl.load(p_ptr + offs, mask=mask, other=0.0)
        m = m + (1.0 - b1) * (g - m)
        v = b2 * v + (1.0 - b2) * g * g
        if ROW > 0:
            col = ((start % ROW).to(tl.int32) + tl.arange(0, BLOCK)) % ROW
            lr = tl.where(col < 3, step0, step_rest)
        else:
            lr = step0
        p = p - lr * m / (tl.sqrt(v) / bc2_sqrt + eps)
        if full:
            tl.store(m_ptr + offs, m)
            tl.store(v_ptr + offs, v)
            tl.store(p_ptr + offs, p)
        else:
            tl.store(m_ptr + offs, m, mask=mask)
            tl.store(v_ptr + offs, v, mask=mask)
            tl.store(p_ptr + offs, p, mask=mask)

    @triton.jit(do_not_specialize=["n0", "n1", "n2", "n3", "n4", "s1", "s2", "s3", "s4", "C", "G", "KD"])
    def _adam_kernel(p0, g0, m0, v0, n0, a0, c0, p1, g1, m1, v1, n1, a1, c1,
                     p2, g2, m2, v2, n2, a2, c2, p3, g3, m3, v3, n3, a3, c3,
                     p4, g4, m4, v4, n4, a4, c4, s1, s2, s3, s4, b1, b2, eps, bc2_sqrt, basis, vsh, C, G, KD,
                     R0: tl.constexpr, R1: tl.constexpr, R2: tl.constexpr, R3: tl.constexpr, R4: tl.constexpr,
                     F0: tl.constexpr, F1: tl.constexpr, F2: tl.constexpr, F3: tl.constexpr, F4: tl.constexpr,
                     BLOCK: tl.constexpr):
        """Segment i: parameter ``p_i`` (``n_i`` elements, rows of ``R_i`` whose first 3 take step
        ``a_i`` and the others ``c_i``; ``R_i`` 0: all ``a_i``), blocks ``s_i`` to ``s_{i+1}`` of the grid;
        ``F_i``: its gradient from the factors ``basis``, ``vsh`` (:func:`_adam_block`)."""
        pid = tl.program_id(0)
        if pid < s1:
            _adam_block(p0, g0, m0, v0, n0, a0, c0, pid, b1, b2, eps, bc2_sqrt, basis, vsh, C, G, KD, R0, F0, BLOCK)
        elif pid < s2:
            _adam_block(p1, g1, m1, v1, n1, a1, c1, pid - s1, b1, b2, eps, bc2_sqrt, basis, vsh, C, G, KD, R1, F1,
                        BLOCK)
        elif pid < s3:
            _adam_block(p2, g2, m2, v2, n2, a2, c2, pid - s2, b1, b2, eps, bc2_sqrt, basis, vsh, C, G, KD, R2, F2,
                        BLOCK)
        elif pid < s4:
            _adam_block(p3, g3, m3, v3, n3, a3, c3, pid - s3, b1, b2, eps, bc2_sqrt, basis, vsh, C, G, KD, R3, F3,
                        BLOCK)
        else:
            _adam_block(p4, g4, m4, v4, n4, a4, c4, pid - s4, b1, b2, eps, bc2_sqrt, basis, vsh, C, G, KD, R4, F4,
                        BLOCK)
