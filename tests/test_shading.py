"""SH colours with a deferred coefficient gradient (insitu.render.shading) and Adam taking it factored."""
import pytest
import torch

from insitu.render.rendering import eval_sh
from insitu.render.shading import DeferredGradients, dense_gradient, deferred_sh_gradients, sh_colors
from insitu.training.adam import ShardAdam


def _inputs(N=50, C=3, K=16, dtype=torch.float64, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    means = torch.randn(N, 3, generator=g, dtype=dtype).to(device).requires_grad_()
    coeffs = (0.3 * torch.randn(N, K, 3, generator=g, dtype=dtype)).to(device).requires_grad_()
    campos = (4 * torch.randn(C, 3, generator=g, dtype=dtype)).to(device)
    v = torch.randn(C, N, 3, generator=g, dtype=dtype).to(device)
    return means, coeffs, campos, v


def _reference(means, coeffs, campos, degree):
    C = campos.shape[0]
    raw = eval_sh(degree, means[None] - campos[:, None], coeffs[None].expand(C, *coeffs.shape))
    return torch.clamp_min(raw + 0.5, 0.0)


@pytest.mark.parametrize("degree", [0, 1, 2, 3])
def test_sh_colors_and_gradients_match_autograd_of_the_reference(degree):
    means, coeffs, campos, v = _inputs(seed=degree)
    out = sh_colors(means, coeffs, campos, degree)
    ref = _reference(means, coeffs, campos, degree)
    torch.testing.assert_close(out, ref)
    gm, gc = torch.autograd.grad((out * v).sum(), (means, coeffs))
    rm, rc = torch.autograd.grad((ref * v).sum(), (means, coeffs), allow_unused=True)
    torch.testing.assert_close(gm, torch.zeros_like(means) if rm is None else rm)
    torch.testing.assert_close(gc, rc)
    assert (gc[:, (degree + 1) ** 2:] == 0).all()


def test_the_clamp_at_zero_stops_the_gradient():
    means, coeffs, campos, v = _inputs(N=40, C=2)
    with torch.no_grad():
        coeffs[:20] = 0.0
        coeffs[:20, 0] = -5.0                         # these colours are clamped to 0 in every view
    out = sh_colors(means, coeffs, campos, 3)
    assert (out[:, :20] == 0).all()
    gm, gc = torch.autograd.grad((out * v).sum(), (means, coeffs))
    assert gm[:20].abs().max() == 0 and gc[:20].abs().max() == 0
    rm, rc = torch.autograd.grad((_reference(means, coeffs, campos, 3) * v).sum(), (means, coeffs))
    torch.testing.assert_close(gm, rm)
    torch.testing.assert_close(gc, rc)


def test_deferred_gradient_is_kept_factored_and_equals_the_dense_one():
    means, coeffs, campos, v = _inputs()
    ref = torch.autograd.grad((_reference(means, coeffs, campos, 2) * v).sum(), coeffs)[0]
    with deferred_sh_gradients() as sh:
        out = sh_colors(means, coeffs, campos, 2)
    (out * v).sum().backward()                        # after the block: the factors still go to it
    assert coeffs.grad is None and means.grad is not None
    basis, v_sh = sh.pop(coeffs)
    assert basis.shape == (3, 50, 9) and v_sh.shape == (3, 50, 3)
    torch.testing.assert_close(dense_gradient(basis, v_sh, 16), ref)
    assert sh.pop(coeffs) is None                     # taken once


def test_a_gradient_computed_from_the_parameter_is_not_deferred():
    means, coeffs, campos, v = _inputs()
    ref = torch.autograd.grad((_reference(means, coeffs, campos, 3) * v).sum(), coeffs)[0]
    with deferred_sh_gradients() as sh:
        out = sh_colors(means, coeffs * 1.0, campos, 3)   # not the parameter: its gradient must reach it
    (out * v).sum().backward()
    assert sh.factors == []
    torch.testing.assert_close(coeffs.grad, ref)


def test_shard_adam_refuses_factors_of_another_shape():
    params = {"colors": torch.nn.Parameter(torch.zeros(4, 16, 3))}
    opt = ShardAdam(params, {"colors": (1e-2, 1e-3)})
    sh = DeferredGradients([(params["colors"], torch.ones(1, 5, 16), torch.ones(1, 5, 3))])
    with pytest.raises(ValueError, match=r"colors: expected the factors of \[N, K, 3\] coefficients"):
        opt.step(sh)


def test_deferred_gradients_of_two_passes_join_and_accumulate_into_grad():
    means, coeffs, campos, v = _inputs()
    with deferred_sh_gradients() as sh:
        a = sh_colors(means, coeffs, campos[:2], 1)
        b = sh_colors(means, coeffs, campos[2:], 3)
    ((a * v[:2]).sum() + (b * v[2:]).sum()).backward()
    ref = torch.autograd.grad((_reference(means, coeffs, campos[:2], 1) * v[:2]).sum()
                              + (_reference(means, coeffs, campos[2:], 3) * v[2:]).sum(), coeffs)[0]
    coeffs.grad = torch.ones_like(coeffs)
    sh.accumulate(coeffs)
    torch.testing.assert_close(coeffs.grad, ref + 1)
    assert sh.factors == []


def test_sh_colors_rejects_bad_shapes():
    means, coeffs, campos, _ = _inputs()
    with pytest.raises(ValueError, match=r"coeffs: expected \[50, K >= 16, 3\]"):
        sh_colors(means, coeffs[:, :9], campos, 3)
    with pytest.raises(ValueError, match="degree in 0..3"):
        sh_colors(means, coeffs, campos, 4)
    with pytest.raises(ValueError, match=r"campos: expected \[C, 3\]"):
        sh_colors(means, coeffs, campos[:, :2], 1)


def _adam_pair(device, dtype=torch.float64):
    g = torch.Generator().manual_seed(5)
    params = {"means": torch.randn(40, 3, generator=g, dtype=dtype), "colors": torch.randn(40, 16, 3, generator=g,
                                                                                          dtype=dtype)}
    make = lambda: {k: torch.nn.Parameter(p.clone().to(device)) for k, p in params.items()}  # noqa: E731
    lrs = {"means": 1e-2, "colors": (3e-2, 2e-3)}
    return make(), make(), lrs


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_shard_adam_takes_the_factored_gradient_as_the_written_out_one(device):
    dtype = torch.float64 if device == "cpu" else torch.float32
    pa, pb, lrs = _adam_pair(device, dtype)
    a, b = ShardAdam(pa, lrs), ShardAdam(pb, lrs)
    for step in range(4):
        _, _, campos, v = _inputs(N=40, C=2, dtype=dtype, device=device, seed=step)
        degree = min(step, 3)
        with deferred_sh_gradients() as sh:
            out = sh_colors(pa["means"], pa["colors"], campos, degree)
        (out * v).sum().backward()
        assert pa["colors"].grad is None
        a.step(sh)
        a.zero_grad()
        (sh_colors(pb["means"], pb["colors"], campos, degree) * v).sum().backward()
        b.step()
        b.zero_grad()
        for k in pa:
            torch.testing.assert_close(pa[k], pb[k], rtol=1e-5, atol=1e-6)


def test_pop_joins_factors_of_different_degrees():
    sh = DeferredGradients()
    coeffs = torch.zeros(4, 16, 3)
    sh.factors.append((coeffs, torch.ones(1, 4, 4), torch.ones(1, 4, 3)))
    sh.factors.append((coeffs, torch.ones(2, 4, 9), torch.ones(2, 4, 3)))
    basis, v_sh = sh.pop(coeffs)
    assert basis.shape == (3, 4, 9) and v_sh.shape == (3, 4, 3)
    assert basis[0, :, 4:].abs().max() == 0


@pytest.mark.gpu
@pytest.mark.parametrize("degree", [0, 1, 2, 3])
def test_triton_sh_kernels_match_the_torch_path_and_gsplat(degree):
    from gsplat.cuda._wrapper import spherical_harmonics

    from insitu.render import shading

    means, coeffs, campos, v = _inputs(N=1000, C=3, dtype=torch.float32, device="cuda", seed=degree)
    with torch.no_grad():
        coeffs[:100, 0] = -3.0                        # some clamped colours
    out = sh_colors(means, coeffs, campos, degree)
    ref = shading._forward_torch(means, coeffs, campos, degree)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    with torch.no_grad():                             # the evaluation's variant saves nothing
        torch.testing.assert_close(sh_colors(means, coeffs, campos, degree), out)
    out2, saved = shading._forward_triton(means, coeffs, campos, degree, save=True)
    basis, v_sh, v_means = shading._backward_triton(means, campos, v, *saved)
    rb, rv, rm = shading._backward_torch(means, coeffs, campos, degree, v)
    torch.testing.assert_close(basis, rb, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(v_sh, rv)
    torch.testing.assert_close(v_means, rm, rtol=1e-4, atol=1e-5)
    # gsplat's own SH (its CUDA kernels) and its gradients, through the same clamp
    m2, c2 = means.detach().clone().requires_grad_(), coeffs.detach().clone().requires_grad_()
    dirs = m2[None] - campos[:, None]
    g = torch.clamp_min(spherical_harmonics(degree, dirs, c2[None].expand(3, *c2.shape)) + 0.5, 0.0)
    torch.testing.assert_close(out, g, rtol=1e-5, atol=1e-5)
    (g * v).sum().backward()
    gm, gc = torch.autograd.grad((out * v).sum(), (means, coeffs))
    torch.testing.assert_close(gm, m2.grad, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(gc, c2.grad, rtol=1e-4, atol=1e-5)
