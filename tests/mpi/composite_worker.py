"""Multi-rank check of insitu.render.compositing against the serial front-to-back composite.

Run as ``mpiexec -n P python composite_worker.py [DEVICE]`` (DEVICE ``cpu``, the default, or
``cuda`` for NCCL with one GPU per rank); exits non-zero on any mismatch.
"""
import sys

import torch

from insitu.parallel.comm import init_comm, shutdown
from insitu.render.compositing import band_rows, composite, composite_full, gather_bands


def layers(P, B, H, W, seed, dtype=torch.float64, D=3):
    """Every rank's layer of D channels, the same on all ranks: Gaussian-like blobs, some alphas exactly 1."""
    g = torch.Generator().manual_seed(seed)
    y, x = torch.meshgrid(torch.arange(H, dtype=dtype), torch.arange(W, dtype=dtype), indexing="ij")
    alpha = torch.zeros(P, B, H, W, 1, dtype=dtype)
    for _ in range(3):
        c = torch.rand(P, B, 2, 1, 1, generator=g, dtype=dtype) * torch.tensor([H, W], dtype=dtype).view(2, 1, 1)
        s = 0.5 + 2 * torch.rand(P, B, 1, 1, generator=g, dtype=dtype)
        a = torch.rand(P, B, 1, 1, generator=g, dtype=dtype)
        alpha[..., 0] += a * torch.exp(-((y - c[:, :, 0]) ** 2 + (x - c[:, :, 1]) ** 2) / (2 * s * s))
    alpha = alpha.clamp(0, 0.999)
    alpha[torch.rand(alpha.shape, generator=g, dtype=dtype) < 0.1] = 1.0
    rgb = torch.rand(P, B, H, W, D, generator=g, dtype=dtype) * alpha
    order = torch.randint(0, 3, (B, P), generator=g).to(dtype)      # ties on purpose
    return rgb, alpha, order


def serial(rgb, alpha, order):
    """Front-to-back over all layers (ties by rank), plain autograd: [B, H, W, D + 1]."""
    P, B = rgb.shape[:2]
    out = []
    for b in range(B):
        acc, T = 0, 1
        for r in sorted(range(P), key=lambda r: (float(order[b, r]), r)):
            acc = acc + T * torch.cat([rgb[r, b], alpha[r, b]], dim=-1)
            T = T * (1 - alpha[r, b])
        out.append(acc)
    return torch.stack(out)


def check(name, got, want, tol):
    got = got.detach().cpu()
    err = (got - want).abs().max().item() if got.numel() else 0.0
    if not (got.shape == want.shape and err <= tol):
        print(f"FAIL {name}: shape {tuple(got.shape)} vs {tuple(want.shape)}, max error {err:.3g}", flush=True)
        sys.exit(1)


def main(device):
    comm = init_comm(device=device, timeout_s=60)
    dev = comm.device
    P, r = comm.size, comm.rank
    # H not a multiple of P; H < P gives empty bands; D = 6: the lit model's base colour and normal
    for (B, H, W, D) in [(3, 7, 5, 3), (2, 3, 4, 3), (2, 5, 4, 6)]:
        rgb_all, alpha_all, order = layers(P, B, H, W, seed=17 + H, D=D)
        ref_rgb = rgb_all.clone().requires_grad_(True)
        ref_alpha = alpha_all.clone().requires_grad_(True)
        full = serial(ref_rgb, ref_alpha, order)
        weight = torch.randn(B, H, W, D + 1, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
        (full * weight).sum().backward()

        rgb = rgb_all[r].to(dev).requires_grad_(True)
        alpha = alpha_all[r].to(dev).requires_grad_(True)
        comm.traffic.reset()
        band = composite(rgb, alpha, order, comm)
        a, b = band_rows(H, P)[r]
        check("forward band", band, full.detach()[:, a:b], 1e-10)
        h = -(-H // P)
        want_fwd = 8 * (P - 1) * B * h * W * (D + 1)    # band layers to the P - 1 other ranks, float64
        if P > 1 and not (comm.traffic.calls == 1 and comm.traffic.bytes == want_fwd):
            print(f"FAIL traffic: {comm.traffic}, expected {want_fwd} bytes in 1 call", flush=True)
            sys.exit(1)
        (band * weight[:, a:b].to(dev)).sum().backward()       # every rank its own band loss
        if P > 1 and not (comm.traffic.calls == 2 and comm.traffic.bytes == 2 * want_fwd):
            print(f"FAIL backward traffic: {comm.traffic}, expected {2 * want_fwd} bytes in 2 calls", flush=True)
            sys.exit(1)
        check("grad rgb", rgb.grad, ref_rgb.grad[r], 1e-10)
        check("grad alpha", alpha.grad, ref_alpha.grad[r], 1e-10)

        gt = composite_full(rgb_all[r].to(dev), alpha_all[r].to(dev), order.to(dev), comm)
        check("composite_full", gt, full.detach()[:, a:b], 1e-10)
        check("gather_bands", gather_bands(gt, comm), full.detach(), 1e-10)

        half = composite_full(rgb_all[r].float().to(dev), alpha_all[r].float().to(dev), order, comm,
                              transfer_dtype=torch.bfloat16)
        check("bfloat16 transfer", half.double(), full.detach()[:, a:b], 2e-2)

    if P == 2:
        gradcheck(comm)
    shutdown(comm)
    print(f"OK rank {r} of {P}", flush=True)


class _Select(torch.autograd.Function):
    """Replicated input -> this rank's slice; the adjoint sums every rank's slice gradient."""

    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        ctx.shape = x.shape
        return x[comm.rank].clone()

    @staticmethod
    def backward(ctx, g):
        full = g.new_zeros(ctx.shape)
        full[ctx.comm.rank] = g
        return ctx.comm.all_reduce_sum(full), None


class _Assemble(torch.autograd.Function):
    """Bands -> full image on every rank; with replicated output gradients the adjoint is the own rows."""

    @staticmethod
    def forward(ctx, band, comm, rows):
        ctx.rows = rows
        return gather_bands(band, comm)

    @staticmethod
    def backward(ctx, g):
        a, b = ctx.rows
        return g[:, a:b].contiguous(), None, None


def gradcheck(comm):
    """torch.autograd.gradcheck of the whole distributed map, all layers replicated as inputs."""
    P, B, H, W = comm.size, 1, 3, 2
    rgb_all, alpha_all, order = layers(P, B, H, W, seed=3)
    alpha_all = alpha_all.clamp(max=0.9)     # finite differences need room around each alpha

    def fn(rgb_all, alpha_all):
        band = composite(_Select.apply(rgb_all, comm), _Select.apply(alpha_all, comm), order, comm)
        return _Assemble.apply(band, comm, band_rows(H, P)[comm.rank])

    inputs = (rgb_all.to(comm.device).requires_grad_(True), alpha_all.to(comm.device).requires_grad_(True))
    ok = torch.autograd.gradcheck(fn, inputs, eps=1e-6, atol=1e-8, raise_exception=False)
    if not ok:
        print("FAIL gradcheck", flush=True)
        sys.exit(1)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "cpu")
