"""The ray caster as one Triton kernel (CUDA).

It follows the torch reference (:mod:`insitu.groundtruth.torch_caster`) step by step; the GPU
tests compare the two.
"""
from __future__ import annotations

import torch

from insitu.groundtruth.field import Cameras, CastScene

try:                                    # Triton ships with CUDA builds of torch
    import triton
    import triton.language as tl
except ImportError:                     # pragma: no cover - CPU-only installs
    triton = None

# ---------------------------------------------------------------------------------------------
# The same ray caster as one Triton kernel (CUDA): a program marches BLOCK pixels of one view,
# their supersample rays one after the other, each to its first crossing, refines and shades
# it (the scene's light: the 11 numbers of insitu.render.lighting.Headlight.terms) in registers
# and writes the pixel's averaged RGBA and nearest depth. Same lattice, same
# empty-space jumps (checked before every sample instead of every pass: the jumps are exact,
# so the samples taken outside skipped space are the same), same bisection, secant and shading.
# The refinement, the bracket's two ends and the gradient's six samples each sit in a loop rather
# than in unrolled copies: Triton's coalescing pass grows faster than linearly with the memory
# operations of a kernel (eight loads a trilinear sample), and with the 16 copies unrolled it
# took 17.1 of the 18.5 s that compiling this kernel cost (2.6 s so; a CPU host for sm_90,
# `benchmarks/experiments/bench_compile.py --offline`).

if triton is not None:
    @triton.jit
    def _tri_sample(vol, qx, qy, qz, nx, ny, nz):
        """Trilinear field at index positions (qx, qy, qz), clamped to the samples (border)."""
        x = tl.minimum(tl.maximum(qx, 0.0), (nx - 1).to(tl.float32))
        y = tl.minimum(tl.maximum(qy, 0.0), (ny - 1).to(tl.float32))
        z = tl.minimum(tl.maximum(qz, 0.0), (nz - 1).to(tl.float32))
        x0 = tl.minimum(x.to(tl.int32), nx - 2)
        y0 = tl.minimum(y.to(tl.int32), ny - 2)
        z0 = tl.minimum(z.to(tl.int32), nz - 2)
        fx = x - x0.to(tl.float32)
        fy = y - y0.to(tl.float32)
        fz = z - z0.to(tl.float32)
        i = (z0 * ny + y0) * nx + x0
        sxy = nx * ny
        v000 = tl.load(vol + i)
        v001 = tl.load(vol + i + 1)
        v010 = tl.load(vol + i + nx)
        v011 = tl.load(vol + i + nx + 1)
        v100 = tl.load(vol + i + sxy)
        v101 = tl.load(vol + i + sxy + 1)
        v110 = tl.load(vol + i + sxy + nx)
        v111 = tl.load(vol + i + sxy + nx + 1)
        c00 = v000 + fx * (v001 - v000)
        c01 = v010 + fx * (v011 - v010)
        c10 = v100 + fx * (v101 - v100)
        c11 = v110 + fx * (v111 - v110)
        c0 = c00 + fy * (c01 - c00)
        c1 = c10 + fy * (c11 - c10)
        return c0 + fz * (c1 - c0)

    @triton.jit
    def _tri_bins(f, isos, n_iso):
        """How many iso values are <= f."""
        b = tl.zeros(f.shape, dtype=tl.int32)
        for j in range(n_iso):
            b += (f >= tl.load(isos + j)).to(tl.int32)
        return b

    # integers that are 1 (one subsample, a one-cell macro grid) must stay integers, not constants
    @triton.jit(do_not_specialize=["nx", "ny", "nz", "mx", "my", "mz", "S"])
    def _raycast_kernel(vol, dist, isos, n_iso, cams, rgba_out, depth_out,
                        nx, ny, nz, mx, my, mz,
                        ox, oy, oz, spx, spy, spz,
                        blx, bly, blz, bhx, bhy, bhz, dlx, dly, dlz, dhx, dhy, dhz,
                        step, width, height, S,
                        cr, cg, cb, cvol, cmap_pos, cmap_rgb, n_cmap, c_lo, c_hi,
                        l_amb, l_dif, l_spec, l_kx, l_ky, l_kz, l_key, l_fx, l_fy, l_fz, l_fill,
                        REFINE: tl.constexpr, HAS_CFIELD: tl.constexpr, BLOCK: tl.constexpr):
        view = tl.program_id(1)
        pix = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        pix_ok = pix < width * height
        row = pix // width
        col = pix - row * width
        cam = cams + view * 12
        a00, a01, a02 = tl.load(cam + 0), tl.load(cam + 1), tl.load(cam + 2)
        a10, a11, a12 = tl.load(cam + 3), tl.load(cam + 4), tl.load(cam + 5)
        a20, a21, a22 = tl.load(cam + 6), tl.load(cam + 7), tl.load(cam + 8)
        cx, cy, cz = tl.load(cam + 9), tl.load(cam + 10), tl.load(cam + 11)
        qox = (cx - ox) / spx
        qoy = (cy - oy) / spy
        qoz = (cz - oz) / spz
        rgb_r = tl.zeros((BLOCK,), dtype=tl.float32)
        rgb_g = tl.zeros((BLOCK,), dtype=tl.float32)
        rgb_b = tl.zeros((BLOCK,), dtype=tl.float32)
        hits = tl.zeros((BLOCK,), dtype=tl.float32)
        near = tl.full((BLOCK,), float("inf"), dtype=tl.float32)
        fmx = mx.to(tl.float32)
        fmy = my.to(tl.float32)
        fmz = mz.to(tl.float32)
        for s in range(S * S):
            sr = s // S
            u = col.to(tl.float32) + ((s - sr * S).to(tl.float32) + 0.5) / S
            v = row.to(tl.float32) + (sr.to(tl.float32) + 0.5) / S
            dx = a00 * u + a01 * v + a02
            dy = a10 * u + a11 * v + a12
            dz = a20 * u + a21 * v + a22
            qdx = dx / spx
            qdy = dy / spy
            qdz = dz / spz
            qdx = tl.where(tl.abs(qdx) < 1e-12, 1e-12, qdx)
            qdy = tl.where(tl.abs(qdy) < 1e-12, 1e-12, qdy)
            qdz = tl.where(tl.abs(qdz) < 1e-12, 1e-12, qdz)
            # the owned box, and the whole domain (where the sample lattice starts)
            t1x, t2x = (blx - qox) / qdx, (bhx - qox) / qdx
            t1y, t2y = (bly - qoy) / qdy, (bhy - qoy) / qdy
            t1z, t2z = (blz - qoz) / qdz, (bhz - qoz) / qdz
            t_enter = tl.maximum(tl.maximum(tl.maximum(tl.minimum(t1x, t2x), tl.minimum(t1y, t2y)),
                                            tl.minimum(t1z, t2z)), 0.0)
            t_exit = tl.minimum(tl.minimum(tl.maximum(t1x, t2x), tl.maximum(t1y, t2y)), tl.maximum(t1z, t2z))
            u1x, u2x = (dlx - qox) / qdx, (dhx - qox) / qdx
            u1y, u2y = (dly - qoy) / qdy, (dhy - qoy) / qdy
            u1z, u2z = (dlz - qoz) / qdz, (dhz - qoz) / qdz
            t_dom = tl.maximum(tl.maximum(tl.maximum(tl.minimum(u1x, u2x), tl.minimum(u1y, u2y)),
                                          tl.minimum(u1z, u2z)), 0.0)
            t0 = tl.minimum(t_dom, t_enter)
            dt = step / tl.sqrt(dx * dx + dy * dy + dz * dz)
            active = pix_ok & (t_exit > t_enter)
            b0 = _tri_bins(_tri_sample(vol, qox + t_enter * qdx, qoy + t_enter * qdy, qoz + t_enter * qdz,
                                       nx, ny, nz), isos, n_iso)
            k = tl.floor((t_enter - t0) / dt)
            t = t_enter
            hit = tl.zeros((BLOCK,), dtype=tl.int1)
            ta = t
            tb = t
            iso_i = tl.zeros((BLOCK,), dtype=tl.int32)
            while tl.max(active.to(tl.int32), axis=0) > 0:
                # empty space: jump out of the empty cube of macro cells around the current one
                px = qox + t * qdx
                py = qoy + t * qdy
                pz = qoz + t * qdz
                cellx = tl.minimum(tl.maximum(tl.floor(px / 8.0), 0.0), fmx - 1.0)
                celly = tl.minimum(tl.maximum(tl.floor(py / 8.0), 0.0), fmy - 1.0)
                cellz = tl.minimum(tl.maximum(tl.floor(pz / 8.0), 0.0), fmz - 1.0)
                lin = (cellx + fmx * (celly + fmy * cellz)).to(tl.int32)
                d = tl.load(dist + lin, mask=active, other=0.0)
                radius = tl.maximum(d - 1.0, 0.0)
                bx = tl.where(qdx > 0, (cellx + radius + 1.0) * 8.0, (cellx - radius) * 8.0)
                by = tl.where(qdy > 0, (celly + radius + 1.0) * 8.0, (celly - radius) * 8.0)
                bz = tl.where(qdz > 0, (cellz + radius + 1.0) * 8.0, (cellz - radius) * 8.0)
                t_leave = tl.minimum(tl.minimum((bx - qox) / qdx, (by - qoy) / qdy), (bz - qoz) / qdz)
                empty = d > 0
                t = tl.where(empty, tl.minimum(tl.maximum(t_leave, t), t_exit), t)
                k = tl.where(empty, tl.maximum(tl.floor((t - t0) / dt), k), k)
                # one fine sample on the lattice
                k = k + 1.0
                tn = tl.minimum(t0 + k * dt, t_exit)
                f = _tri_sample(vol, qox + tn * qdx, qoy + tn * qdy, qoz + tn * qdz, nx, ny, nz)
                b = _tri_bins(f, isos, n_iso)
                crossed = active & (b != b0)
                ta = tl.where(crossed, t, ta)
                tb = tl.where(crossed, tn, tb)
                iso_i = tl.where(crossed, tl.where(b > b0, b0, b0 - 1), iso_i)
                hit = hit | crossed
                t = tn
                active = active & ~crossed & (tn < t_exit)
            # bisection, then a secant step
            iso = tl.load(isos + iso_i, mask=hit, other=0.0)
            fa = tl.zeros((BLOCK,), dtype=tl.float32)
            fb = tl.zeros((BLOCK,), dtype=tl.float32)
            for e in range(2):
                te = tl.where(e == 0, ta, tb)
                fe = _tri_sample(vol, qox + te * qdx, qoy + te * qdy, qoz + te * qdz, nx, ny, nz)
                fa = tl.where(e == 0, fe, fa)
                fb = tl.where(e == 1, fe, fb)
            side_a = fa >= iso
            for _ in range(REFINE):
                tm = 0.5 * (ta + tb)
                fm = _tri_sample(vol, qox + tm * qdx, qoy + tm * qdy, qoz + tm * qdz, nx, ny, nz)
                same = (fm >= iso) == side_a
                ta = tl.where(same, tm, ta)
                fa = tl.where(same, fm, fa)
                tb = tl.where(same, tb, tm)
                fb = tl.where(same, fb, fm)
            den = fb - fa
            w = tl.where(den != 0, (iso - fa) / tl.where(den != 0, den, 1.0), 0.5)
            w = tl.minimum(tl.maximum(w, 0.0), 1.0)
            th = ta + w * (tb - ta)
            # the light at the hit
            qx = qox + th * qdx
            qy = qoy + th * qdy
            qz = qoz + th * qdz
            # the field's gradient by central differences, one axis a pass (the sample clamps the
            # other coordinates itself)
            gx = tl.zeros((BLOCK,), dtype=tl.float32)
            gy = tl.zeros((BLOCK,), dtype=tl.float32)
            gz = tl.zeros((BLOCK,), dtype=tl.float32)
            for a in range(3):
                qa = tl.where(a == 0, qx, tl.where(a == 1, qy, qz))
                top = tl.where(a == 0, nx - 1, tl.where(a == 1, ny - 1, nz - 1)).to(tl.float32)
                hi = tl.minimum(qa + 1.0, top)
                lo = tl.maximum(qa - 1.0, 0.0)
                d = (_tri_sample(vol, tl.where(a == 0, hi, qx), tl.where(a == 1, hi, qy), tl.where(a == 2, hi, qz),
                                 nx, ny, nz)
                     - _tri_sample(vol, tl.where(a == 0, lo, qx), tl.where(a == 1, lo, qy),
                                   tl.where(a == 2, lo, qz), nx, ny, nz)) \
                    / ((hi - lo) * tl.where(a == 0, spx, tl.where(a == 1, spy, spz)))
                gx = tl.where(a == 0, d, gx)
                gy = tl.where(a == 1, d, gy)
                gz = tl.where(a == 2, d, gz)
            vx = -qdx * spx
            vy = -qdy * spy
            vz = -qdz * spz
            vn = tl.sqrt(vx * vx + vy * vy + vz * vz)
            vx, vy, vz = vx / vn, vy / vn, vz / vn
            gn = tl.sqrt(gx * gx + gy * gy + gz * gz)
            gs = tl.maximum(gn, 1e-30)
            # the unit normal (the view direction where the gradient vanishes), either side alike
            ux = tl.where(gn > 0, gx / gs, vx)
            uy = tl.where(gn > 0, gy / gs, vy)
            uz = tl.where(gn > 0, gz / gs, vz)
            cos = tl.minimum(tl.abs(ux * vx + uy * vy + uz * vz), 1.0)
            c2 = cos * cos
            c4 = c2 * c2
            c8 = c4 * c4
            c16 = c8 * c8
            intensity = (l_amb + l_dif * cos + l_spec * (c16 * c16)
                         + l_key * tl.abs(ux * l_kx + uy * l_ky + uz * l_kz)
                         + l_fill * tl.abs(ux * l_fx + uy * l_fy + uz * l_fz))
            if HAS_CFIELD:
                value = (_tri_sample(cvol, qx, qy, qz, nx, ny, nz) - c_lo) / (c_hi - c_lo)
                value = tl.minimum(tl.maximum(value, 0.0), 1.0)
                seg = tl.zeros((BLOCK,), dtype=tl.int32)
                for j in range(1, n_cmap - 1):
                    seg += (value >= tl.load(cmap_pos + j)).to(tl.int32)
                p0 = tl.load(cmap_pos + seg)
                p1 = tl.load(cmap_pos + seg + 1)
                wc = (value - p0) / (p1 - p0)
                r0 = tl.load(cmap_rgb + seg * 3)
                g0 = tl.load(cmap_rgb + seg * 3 + 1)
                bb0 = tl.load(cmap_rgb + seg * 3 + 2)
                base_r = r0 + wc * (tl.load(cmap_rgb + seg * 3 + 3) - r0)
                base_g = g0 + wc * (tl.load(cmap_rgb + seg * 3 + 4) - g0)
                base_b = bb0 + wc * (tl.load(cmap_rgb + seg * 3 + 5) - bb0)
            else:
                base_r = tl.zeros((BLOCK,), dtype=tl.float32) + cr
                base_g = tl.zeros((BLOCK,), dtype=tl.float32) + cg
                base_b = tl.zeros((BLOCK,), dtype=tl.float32) + cb
            rgb_r += tl.where(hit, tl.minimum(tl.maximum(base_r * intensity, 0.0), 1.0), 0.0)
            rgb_g += tl.where(hit, tl.minimum(tl.maximum(base_g * intensity, 0.0), 1.0), 0.0)
            rgb_b += tl.where(hit, tl.minimum(tl.maximum(base_b * intensity, 0.0), 1.0), 0.0)
            hits += hit.to(tl.float32)
            near = tl.minimum(near, tl.where(hit, th, float("inf")))
        inv = 1.0 / (S * S).to(tl.float32)
        out = (view * (width * height) + pix).to(tl.int64)
        tl.store(rgba_out + out * 4, rgb_r * inv, mask=pix_ok)
        tl.store(rgba_out + out * 4 + 1, rgb_g * inv, mask=pix_ok)
        tl.store(rgba_out + out * 4 + 2, rgb_b * inv, mask=pix_ok)
        tl.store(rgba_out + out * 4 + 3, hits * inv, mask=pix_ok)
        tl.store(depth_out + out, near, mask=pix_ok)



_TRITON_BLOCK = 128     # pixels per program


def raycast_triton(scene: CastScene, cams: Cameras, width: int, height: int, supersample: int):
    """rgba [C, H, W, 4] and depth [C, H, W] of ``cams`` through the Triton kernel."""
    C = cams.axes.shape[0]
    device = cams.axes.device
    rgba = torch.empty(C, height, width, 4, dtype=torch.float32, device=device)
    depth = torch.empty(C, height, width, dtype=torch.float32, device=device)
    packed = torch.cat([cams.axes.reshape(C, 9), cams.centre], 1).contiguous()
    f = scene.field
    cmap_pos, cmap_rgb = scene.cmap            # host values and device tensors made once (no waits here)
    cvol = scene.color_volume if scene.color_volume is not None else f.volume
    grid = (triton.cdiv(width * height, _TRITON_BLOCK), C)
    _raycast_kernel[grid](
        f.volume, f.distance, scene.isos, scene.isos.numel(), packed, rgba, depth,
        *f.dims, *f.macro, *scene.bounds,
        float(scene.step), width, height, supersample,
        *scene.rgb, cvol, cmap_pos, cmap_rgb.reshape(-1), cmap_pos.numel(), *scene.color_range,
        *scene.light.terms(),
        REFINE=scene.refine, HAS_CFIELD=scene.color_volume is not None, BLOCK=_TRITON_BLOCK)
    return rgba, depth
