"""Trainer on one process (CPU, torch rasterizer): opacity reset, densification, the box,
learning-rate schedules, batched Adam and the band loss scaling."""
from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch
from conftest import sphere_field

from insitu.config import Config, DensifyConfig, TrainConfig
from insitu.groundtruth.scene import make_scene
from insitu.surface.seeds import extract_seeds, init_gaussians
from insitu.training.appearance import ColorModel
from insitu.training.bandloss import band_loss
from insitu.training.ssim import ssim_map
from insitu.training.trainer import Trainer, footprint_errors, render_bands
from insitu.volume import whole_block

N = 16          # samples per axis of the test field
ISO = 5.0       # radius of the sphere (in cells)


@pytest.fixture(scope="module")
def block():
    return whole_block(sphere_field(N))


@pytest.fixture(scope="module")
def scene(block, comm):
    cfg = Config()
    cfg.input.iso = [ISO]
    cfg.views.count, cfg.views.resolution, cfg.views.supersample = 12, 32, 1
    return make_scene(block, cfg, comm)


@pytest.fixture(scope="module")
def shard(block):
    return init_gaussians(extract_seeds(block, ISO), 150, opacity=0.5, sh_degree=0, seed=0)


def train_config(densify: dict | None = None, **kw) -> TrainConfig:
    """Densification and opacity resets off unless asked for (``densify``: DensifyConfig fields); one view
    per step."""
    off = dict(start=10**6, stop=10**7, reset_every=0)
    return TrainConfig(**{"color_model": "sh", "batch": 1, **kw}, densify=DensifyConfig(**{**off, **(densify or {})}))


def make_trainer(shard, block, cfg: TrainConfig, *, extent=None, box=None, max_gaussians=10**6, total=100,
                 pixel_size=None, **kwargs):
    lo, hi = block.box
    if extent is None:
        extent = 0.5 * float(np.linalg.norm(hi - lo))
    if box is None:
        box = (torch.tensor(lo - 2.0, dtype=torch.float32), torch.tensor(hi + 2.0, dtype=torch.float32))
    return Trainer(shard, cfg, extent=extent, box=box, max_gaussians=max_gaussians, device=torch.device("cpu"),
                   total_iterations=total, pixel_size=pixel_size, **kwargs)


def step(trainer: Trainer, scene, comm, it: int, *, seen: list | None = None) -> float:
    """One Trainer step on the next ``batch`` training views; ``seen`` records the means lr used."""
    train = scene.views.train_ids
    B = trainer.cfg.batch
    ids = train[torch.arange(it * B, (it + 1) * B) % len(train)]

    def render(params):
        if seen is not None:
            seen.append(trainer.optimizers["means"].param_groups[0]["lr"])
        return render_bands(params, scene.views, ids, scene.order, comm, background=scene.background,
                            colors=trainer.colors, backend="torch")

    return float(trainer.step(render, scene.gt_on(ids, scene.background), rows=scene.rows, height=scene.views.height,
                              comm=comm))


def assert_optimizers_consistent(trainer: Trainer) -> None:
    n = len(trainer)
    for name, opt in trainer.optimizers.items():
        (p,) = opt.param_groups[0]["params"]
        assert p is trainer.params[name], name
        assert p.shape[0] == n, name
        state = opt.state[p]
        for key in ("exp_avg", "exp_avg_sq"):
            assert state[key].shape == p.shape, (name, key)
        assert set(opt.state) == {p}, f"{name}: state left behind for a replaced parameter"


# ------------------------------------------------------------------------------------------ opacity reset

def test_opacity_reset_runs_at_its_iteration_and_resets_adam(shard, block, scene, comm):
    cfg = train_config(densify=dict(reset_every=3, prune_opacity=0.01))
    trainer = make_trainer(shard, block, cfg, total=10)
    for it in range(2):
        step(trainer, scene, comm, it)
    assert torch.sigmoid(trainer.params["opacities"]).max() > 0.3      # not yet
    step(trainer, scene, comm, 2)
    assert trainer.iteration == 3
    op = torch.sigmoid(trainer.params["opacities"])
    assert op.max() <= 2 * cfg.densify.prune_opacity * (1 + 1e-5)
    assert_optimizers_consistent(trainer)
    state = trainer.optimizers["opacities"].state[trainer.params["opacities"]]
    assert torch.count_nonzero(state["exp_avg"]) == 0 and torch.count_nonzero(state["exp_avg_sq"]) == 0
    other = trainer.optimizers["colors"].state[trainer.params["colors"]]
    assert torch.count_nonzero(other["exp_avg"]) > 0                    # only the opacities' state is reset
    step(trainer, scene, comm, 3)                                       # training goes on from there
    assert torch.isfinite(trainer.params["opacities"]).all()


def test_no_opacity_reset_when_disabled(shard, block, scene, comm):
    trainer = make_trainer(shard, block, train_config(densify=dict(reset_every=0, prune_opacity=0.01)), total=10)
    for it in range(3):
        step(trainer, scene, comm, it)
    assert torch.sigmoid(trainer.params["opacities"]).min() > 0.3


def test_the_last_iteration_does_not_reset_the_opacities(shard, block, scene, comm):
    """With iterations a multiple of densify.reset_every (the defaults: 3000 and 3000), the
    reset must not be the last thing training does: the model handed on would be transparent."""
    cfg = train_config(densify=dict(reset_every=3, prune_opacity=0.01))
    trainer = make_trainer(shard, block, cfg, total=3)
    for it in range(3):
        step(trainer, scene, comm, it)
    assert torch.sigmoid(trainer.params["opacities"]).max() > 0.3


# ------------------------------------------------------------------------------------------ densification

def densify_config(densify: dict | None = None, **kw) -> TrainConfig:
    """Densify after every step; every Gaussian with a positional gradient counts as high (``densify``:
    DensifyConfig fields over these)."""
    every_step = dict(start=0, every=1, grad_threshold=0.0, reset_every=10**6)
    return train_config(**{"lr_means": 1e-9, "lr_means_final": 1e-10, **kw}, densify={**every_step, **(densify or {})})


def test_clone_adds_copies_of_small_gaussians(shard, block, scene, comm):
    n0 = len(shard)
    trainer = make_trainer(shard, block, densify_config(), extent=1e4)      # 0.01 * extent: all small
    step(trainer, scene, comm, 0)
    n1 = len(trainer)
    assert n0 < n1 <= 2 * n0
    g = trainer.gaussians()
    head = {k: v[:n0] for k, v in g.tensors().items()}
    # every appended Gaussian is an exact copy of one of the first n0
    match = (g.means[n0:, None, :] == head["means"][None]).all(-1)          # [n1 - n0, n0]
    assert match.any(1).all()
    src = match.float().argmax(1)
    for name, t in g.tensors().items():
        assert torch.equal(t[n0:], head[name][src]), name
    assert_optimizers_consistent(trainer)
    state = trainer.optimizers["means"].state[trainer.params["means"]]
    assert torch.count_nonzero(state["exp_avg"][n0:]) == 0
    assert len(trainer.state.grad2d) == n1 and len(trainer.state.count) == n1
    step(trainer, scene, comm, 1)                                           # Adam accepts the new tensors
    assert len(trainer) > n1
    assert_optimizers_consistent(trainer)


def test_split_replaces_large_gaussians_by_two_smaller(shard, block, scene, comm):
    n0 = len(shard)
    before = shard.scales.max().item()
    trainer = make_trainer(shard, block, densify_config(), extent=1e-3)     # 0.01 * extent: all large
    step(trainer, scene, comm, 0)
    n1 = len(trainer)
    k = n1 - n0
    assert k > 0
    g = trainer.gaussians()
    a, b = slice(n1 - 2 * k, n1 - k), slice(n1 - k, n1)                    # the two halves of each split
    assert torch.equal(g.log_scales[a], g.log_scales[b]) and torch.equal(g.quats[a], g.quats[b])
    assert not torch.equal(g.means[a], g.means[b])
    assert g.scales[n1 - 2 * k:].max() <= before / 1.6 * 1.01
    assert_optimizers_consistent(trainer)
    state = trainer.optimizers["scales"].state[trainer.params["scales"]]
    assert torch.count_nonzero(state["exp_avg"][n1 - 2 * k:]) == 0
    step(trainer, scene, comm, 1)
    assert_optimizers_consistent(trainer)


def test_prune_removes_low_opacity_gaussians(shard, block, scene, comm):
    g = dataclasses.replace(shard, opacity_logits=shard.opacity_logits.clone())
    low = torch.arange(len(g)) % 3 == 0
    g.opacity_logits[low] = math.log(1e-4 / (1 - 1e-4))
    keep_means = g.means[~low]
    trainer = make_trainer(g, block, densify_config(dict(grad_threshold=1e9, prune_opacity=0.005)))   # no growth
    step(trainer, scene, comm, 0)
    assert len(trainer) == int((~low).sum())
    assert torch.sigmoid(trainer.params["opacities"]).min() >= 0.005
    assert torch.allclose(trainer.params["means"], keep_means, atol=1e-4)
    assert_optimizers_consistent(trainer)
    step(trainer, scene, comm, 1)


@pytest.mark.parametrize("extent", [1e4, 1e-3], ids=["clone", "split"])
def test_densification_respects_max_gaussians(shard, block, scene, comm, extent):
    cap = len(shard) + 7
    trainer = make_trainer(shard, block, densify_config(), extent=extent, max_gaussians=cap)
    for it in range(3):
        step(trainer, scene, comm, it)
        assert len(trainer) <= cap
    assert len(trainer) == cap
    assert_optimizers_consistent(trainer)


# ------------------------------------------------------------------------------------------ the box

def shrunk_box(block, by: float):
    lo, hi = block.box
    return torch.tensor(lo + by, dtype=torch.float32), torch.tensor(hi - by, dtype=torch.float32)


def assert_inside(means, box):
    assert (means >= box[0]).all() and (means <= box[1]).all()


def test_means_stay_in_the_box_with_a_huge_learning_rate(shard, block, scene, comm):
    box = shrunk_box(block, 4.0)                    # smaller than the sphere: many seeds start outside
    assert not ((shard.means >= box[0]) & (shard.means <= box[1])).all()
    cfg = train_config(lr_means=100.0, lr_means_final=100.0)
    trainer = make_trainer(shard, block, cfg, box=box)
    for it in range(3):
        step(trainer, scene, comm, it)
        assert_inside(trainer.params["means"], box)
        assert torch.isfinite(trainer.params["means"]).all()
    assert (trainer.params["means"] == box[1]).any() and (trainer.params["means"] == box[0]).any()


def test_means_stay_in_the_box_after_a_split(shard, block, scene, comm):
    """A split draws the new means around the old ones: the step must still leave them in the box."""
    box = shrunk_box(block, 4.0)
    trainer = make_trainer(shard, block, densify_config(lr_means=100.0, lr_means_final=100.0), extent=1e-3,
                           box=box)
    step(trainer, scene, comm, 0)
    assert len(trainer) > len(shard)                # it did split
    assert_inside(trainer.params["means"], box)


def test_a_disc_stays_at_least_a_thousandth_as_thick_as_it_is_wide(shard, block, scene, comm):
    """Every step leaves each Gaussian's thickness (its normal's standard deviation) at least 1e-3 of its larger
    in-plane one, whatever the rates: thinner, its covariance is no longer positive in float32 (a sphere's training
    went non-finite after 1222 iterations with a disc of 6e-5 over 0.26); discs thick enough stay as they are."""
    thin = shard.detach()
    thin.log_scales[::2, 2] = thin.log_scales[::2, :2].max(1).values + math.log(1e-6)
    before = thin.log_scales.clone()
    trainer = make_trainer(thin, block, train_config(lr_scales=0.0))
    step(trainer, scene, comm, 0)
    scales = trainer.params["scales"].detach()
    ratio = scales[:, 2] - scales[:, :2].max(1).values
    assert (ratio >= math.log(1e-3) - 1e-5).all()
    assert torch.allclose(ratio[::2], torch.full_like(ratio[::2], math.log(1e-3)), atol=1e-5)
    assert torch.equal(scales[1::2], before[1::2])


def test_scales_keep_the_floor_of_a_pixel_of_the_nearest_training_view(shard, block, scene, comm):
    """With ``pixel_size`` (pipeline: the training views'), every step leaves each Gaussian's two in-plane
    standard deviations at least ``min_scale_px`` pixels of the nearest training view that sees it, its
    normal axis (z) as trained; a Gaussian no view sees has no floor; 0 turns the floor off."""
    from insitu.groundtruth.views import pixel_size

    g = dataclasses.replace(shard, log_scales=shard.log_scales.clone())
    g.log_scales[::2] = math.log(1e-3)                  # far below a pixel
    g.log_scales[::2, 2] = math.log(1e-4)
    size = lambda means: pixel_size(means, scene.views, scene.views.train_ids)   # noqa: E731
    cfg = train_config(min_scale_px=1.5)
    trainer = make_trainer(g, block, cfg, pixel_size=size)
    for it in range(2):
        step(trainer, scene, comm, it)
        kept = torch.exp(trainer._floor)                 # set by the first step, from the means it left
        scales = torch.exp(trainer.params["scales"])
        assert torch.isfinite(kept).all() and (scales[:, :2] >= kept[:, None]).all()
        floor = 1.5 * size(trainer.params["means"])      # after the second step the means moved a little
        torch.testing.assert_close(kept, floor, rtol=1e-5 if it == 0 else 1e-2, atol=0)
    assert (scales[::2, 2] < 1e-3).all()                 # the disc's thin axis is not raised
    assert (scales[::2, :2] < 1.05 * kept[::2, None]).all()   # raised to the floor (and a step's growth)
    off = make_trainer(g, block, train_config(min_scale_px=0.0), pixel_size=size)
    step(off, scene, comm, 0)
    assert torch.exp(off.params["scales"][::2, :2]).max() < 0.01


# ------------------------------------------------------------------------------------------ learning rates

@pytest.mark.parametrize("batch", [1, 2])
def test_means_learning_rate_decays_log_linearly_to_the_final_value(shard, block, scene, comm, batch):
    cfg = train_config(lr_means=1e-3, lr_means_final=1e-5, batch=batch)
    extent, T = 3.0, 6
    trainer = make_trainer(shard, block, cfg, extent=extent, total=T)
    seen: list[float] = []
    for it in range(T):
        step(trainer, scene, comm, it, seen=seen)
    lr0 = 1e-3 * extent * math.sqrt(batch)
    lr1 = 1e-5 * extent * math.sqrt(batch)
    per_step = (lr1 / lr0) ** (1 / T)
    ratios = np.array(seen[1:]) / np.array(seen[:-1])
    np.testing.assert_allclose(ratios, per_step, rtol=1e-6)            # geometric, T steps from lr0 to lr1
    assert lr0 * per_step * (1 - 1e-6) <= seen[0] <= lr0 * (1 + 1e-6)  # starts at lr0 (t = 0 or 1/T) ...
    assert lr1 * (1 - 1e-6) <= seen[-1] <= lr1 / per_step * (1 + 1e-6)  # ... ends at lr1 (t = 1 - 1/T or 1)


def test_a_warm_steps_means_rate_runs_the_first_iterations_of_a_cold_steps_schedule(shard, block, scene, comm):
    """schedule 12 over 4 iterations: the rates of a 12-iteration schedule's first 4 (a third of the way down)."""
    cfg = train_config(lr_means=1e-3, lr_means_final=1e-5)
    cold, warm = [], []
    trainer = make_trainer(shard, block, cfg, extent=1.0, total=12)
    for it in range(12):
        step(trainer, scene, comm, it, seen=cold)
    trainer = make_trainer(shard, block, cfg, extent=1.0, total=4, schedule=12)
    for it in range(4):
        step(trainer, scene, comm, it, seen=warm)
    np.testing.assert_allclose(warm, cold[:4], rtol=1e-9)


def test_settled_gaussians_opacities_take_a_tenth_of_their_step(shard, block, scene, comm):
    """A warm start's settled Gaussians (every other one): in the first step their opacities move a tenth of
    what the same step moves them without the flag, every other parameter as without it; the flag follows the
    Gaussians through densification (the copies of settled ones settled)."""
    settled = torch.arange(len(shard)) % 2 == 0
    free = make_trainer(shard, block, train_config())
    slow = make_trainer(shard, block, train_config(), settled=settled)
    step(free, scene, comm, 0)
    step(slow, scene, comm, 0)
    moved = free.params["opacities"].detach() - shard.opacity_logits
    got = slow.params["opacities"].detach() - shard.opacity_logits
    assert moved[settled].abs().min() > 0
    torch.testing.assert_close(got[settled], Trainer.SETTLED_OPACITY_RATE * moved[settled], rtol=1e-5, atol=1e-9)
    torch.testing.assert_close(got[~settled], moved[~settled], rtol=0, atol=0)
    for name in ("means", "scales", "quats", "colors"):
        torch.testing.assert_close(slow.params[name], free.params[name], rtol=0, atol=0)
    dense = make_trainer(shard, block, densify_config(), extent=1e4, settled=settled)    # clones of all
    step(dense, scene, comm, 0)
    n0, n1 = len(shard), len(dense)
    assert n1 > n0 and len(dense.opacity_rate) == n1
    src = (dense.params["means"][n0:, None, :] == dense.params["means"][None, :n0]).all(-1).float().argmax(1)
    assert torch.equal(dense.opacity_rate[n0:], dense.opacity_rate[src])
    assert torch.equal(dense.opacity_rate[:n0], torch.where(settled, 0.1, 1.0))


def test_the_other_rates_stay_constant(shard, block, scene, comm):
    """Only the means' rate follows a schedule: the others keep their own over the whole training."""
    T = 5
    constant = make_trainer(shard, block, train_config(), total=T)
    rates = {k: v.param_groups[0]["lr"] for k, v in constant.optimizers.items() if k != "means"}
    for it in range(T):
        step(constant, scene, comm, it)
    assert rates == {k: v.param_groups[0]["lr"] for k, v in constant.optimizers.items() if k != "means"}


def test_a_means_rate_of_zero_holds_the_means_and_a_final_rate_of_zero_is_reached_linearly(shard, block, scene,
                                                                                         comm):
    """lr_means 0 (model.ply's training, plyfit.refine_for_viewers): the means do not move; lr_means_final 0:
    the rate falls linearly from lr_means to 0 over the schedule (an exponential never reaches 0)."""
    trainer = make_trainer(shard, block, train_config(lr_means=0.0, lr_means_final=0.0), total=4)
    before = trainer.params["means"].detach().clone()
    seen: list[float] = []
    for it in range(4):
        step(trainer, scene, comm, it, seen=seen)
    assert seen == [0.0] * 4 and torch.equal(trainer.params["means"].detach(), before)
    assert not torch.equal(trainer.params["opacities"].detach(), make_trainer(shard, block, train_config()).params[
        "opacities"].detach())                                             # the others trained
    trainer = make_trainer(shard, block, train_config(lr_means=1e-3, lr_means_final=0.0), extent=2.0, total=4)
    seen = []
    for it in range(4):
        step(trainer, scene, comm, it, seen=seen)
    np.testing.assert_allclose(seen, [2e-3 * (1 - t / 4) for t in range(4)], rtol=1e-6)


def test_batched_adam_scales_lr_by_sqrt_batch_and_powers_the_betas(shard, block, scene, comm):
    B = 4
    cfg = train_config(batch=B)
    trainer = make_trainer(shard, block, cfg)
    expected = {"scales": cfg.lr_scales, "quats": cfg.lr_quats, "opacities": cfg.lr_opacities,
                "colors": cfg.lr_sh0}
    for _ in range(2):
        for name, lr in expected.items():
            group = trainer.optimizers[name].param_groups[0]
            assert group["lr"] == pytest.approx(lr * math.sqrt(B), rel=1e-12), name
        assert trainer.adam.betas == pytest.approx((0.9 ** B, 0.999 ** B), rel=1e-12)
        assert trainer.optimizers["colors"].param_groups[0]["lr_rest"] == pytest.approx(cfg.lr_shN * math.sqrt(B))
        step(trainer, scene, comm, 0)
    one = make_trainer(shard, block, train_config(batch=1))
    assert one.optimizers["colors"].param_groups[0]["lr"] == pytest.approx(cfg.lr_sh0)
    assert one.adam.betas == pytest.approx((0.9, 0.999))


# ------------------------------------------------------------------------------------------ band loss

@pytest.mark.parametrize("height", [16, 6], ids=["l1+ssim", "l1 only (image < 11 rows)"])
def test_band_loss_on_one_rank_is_the_image_loss(height):
    """(1 - w) mean |pred - gt| + w (1 - SSIM), with SSIM the mean of ssim_map (torchmetrics' value
    on the reflect-padded images); an image under 11 rows has no SSIM window: L1 alone."""
    g = torch.Generator().manual_seed(3)
    pred = torch.rand(2, height, 16, 3, generator=g, dtype=torch.float64)
    gt = torch.rand(2, height, 16, 3, generator=g, dtype=torch.float64)
    loss = band_loss(pred, gt, ssim_weight=0.2, rows=(0, height), height=height)
    l1 = (pred - gt).abs().mean().item()
    if height >= 11:
        want = 0.8 * l1 + 0.2 * (1 - ssim_map(pred, gt).mean().item())
        assert loss.item() == pytest.approx(want, rel=1e-12)
        assert loss.item() != pytest.approx(l1, rel=1e-3)
    else:
        assert loss.item() == pytest.approx(l1, rel=1e-12)
    assert band_loss(pred, gt, ssim_weight=0.0, rows=(0, height), height=height).item() == pytest.approx(l1, rel=1e-12)
    if height >= 11:
        with pytest.raises(ValueError, match="whole image"):
            band_loss(pred[:, :4], gt[:, :4], ssim_weight=0.2, rows=(0, 4), height=height)


def test_band_loss_squared_error_term():
    """pixel="l2": (1 - w) sum e^2 / (2 n mean_fg|e|) + w (1 - SSIM), mean_fg|e| the mean |e| over the
    foreground's values, a number without gradient: autograd of a plain torch version agrees; the
    gradient of the pixel term is e / (n mean_fg|e|), of mean size 1 / n (L1's) on the foreground whatever
    the error's size, and framing the same foreground with more background changes a foreground
    value's gradient as it changes L1's (by the count n); no foreground: the mean over every value."""
    g = torch.Generator().manual_seed(5)
    pred = torch.rand(2, 16, 16, 3, generator=g, dtype=torch.float64)
    fg = torch.zeros(2, 16, 16, 1, dtype=torch.bool)
    fg[:, 4:12, 3:9] = True
    for size in (1.0, 0.01):
        gt = (pred + size * (torch.rand(pred.shape, generator=g, dtype=torch.float64) - 0.5) * fg).detach()
        x = pred.clone().requires_grad_()
        loss = band_loss(x, gt, ssim_weight=0.2, rows=(0, 16), height=16, pixel="l2", foreground=fg)
        loss.backward()
        y = pred.clone().requires_grad_()
        e = y - gt
        mean_fg = (e.abs() * fg).sum().detach() / (fg.sum() * 3)
        ref = 0.8 * (e ** 2).sum() / (2 * e.numel() * mean_fg) + 0.2 * (1 - ssim_map(y, gt).mean())
        ref.backward()
        assert loss.item() == pytest.approx(ref.item(), rel=1e-12)
        assert torch.allclose(x.grad, y.grad, rtol=1e-10, atol=1e-15)
        z = pred.clone().requires_grad_()
        band_loss(z, gt, ssim_weight=0.0, rows=(0, 16), height=16, pixel="l2", foreground=fg).backward()
        e = (pred - gt)
        mask = fg.expand_as(e)
        assert torch.allclose(z.grad, e / (e.numel() * e[mask].abs().mean()), rtol=1e-12, atol=0)
        assert z.grad[mask].abs().mean().item() == pytest.approx(1 / e.numel(), rel=1e-9)
        # the same foreground framed by twice the background: its gradients scale as L1's, by the count
        w = torch.cat([pred, pred], 2).requires_grad_()
        band_loss(w, torch.cat([gt, pred], 2), ssim_weight=0.0, rows=(0, 16), height=16, pixel="l2",
                  foreground=torch.cat([fg, fg & False], 2)).backward()
        assert torch.allclose(w.grad[:, :, :16] * 2, z.grad, rtol=1e-12, atol=0)
    q = pred.clone().requires_grad_()
    band_loss(q, gt, ssim_weight=0.0, rows=(0, 16), height=16, pixel="l2",
              foreground=torch.zeros_like(fg)).backward()
    assert torch.allclose(q.grad, (pred - gt) / (e.numel() * (pred - gt).abs().mean()), rtol=1e-12, atol=0)
    with pytest.raises(ValueError, match="pixel: expected one of"):
        band_loss(pred, pred, ssim_weight=0.2, rows=(0, 16), height=16, pixel="l3")
    with pytest.raises(ValueError, match=r"foreground: expected \[B, h, W, 1\]"):
        band_loss(pred, gt, ssim_weight=0.2, rows=(0, 16), height=16, pixel="l2", foreground=fg[..., 0])


@pytest.mark.gpu
@pytest.mark.parametrize("pixel", ["l1", "l2"])
def test_band_loss_on_cuda_matches_the_cpu(pixel):
    """On CUDA the SSIM term (and L1) come from the SSIM kernels, the squared error from torch: loss and
    gradient equal the CPU's torch operations in float32."""
    g = torch.Generator().manual_seed(11)
    pred = torch.rand(3, 40, 56, 3, generator=g)
    gt = (pred + 0.2 * torch.rand(pred.shape, generator=g)).clamp(0, 1)
    out = []
    for device in ("cpu", "cuda"):
        x = pred.to(device).clone().requires_grad_()
        loss = band_loss(x, gt.to(device), ssim_weight=0.2, rows=(0, 40), height=40, pixel=pixel)
        loss.backward()
        out.append((loss.item(), x.grad.cpu()))
    assert out[1][0] == pytest.approx(out[0][0], rel=1e-5)
    assert torch.allclose(out[1][1], out[0][1], rtol=1e-4, atol=1e-4 * out[0][1].abs().max().item())


# ------------------------------------------------------------------------------------------ Adam

@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_shard_adam_equals_torch_adam_on_each_parameter(device):
    """One ShardAdam step (one kernel launch on CUDA) = torch.optim.Adam on every parameter apart,
    SH band 0 and the other bands of the colours at their own rates, learning rates changed
    between steps included; a parameter without a gradient is left alone."""
    from insitu.training.adam import ShardAdam

    g = torch.Generator().manual_seed(5)
    shapes = {"means": (70, 3), "scales": (70, 3), "quats": (70, 4), "opacities": (70,), "colors": (70, 16, 3)}
    start = {k: torch.randn(*s, generator=g).to(device) for k, s in shapes.items()}
    ours = {k: torch.nn.Parameter(t.clone()) for k, t in start.items()}
    lrs = {"means": 1e-3, "scales": 5e-3, "quats": 1e-3, "opacities": 5e-2, "colors": (2e-3, 1e-4)}
    betas = (0.9 ** 2, 0.999 ** 2)
    adam = ShardAdam(ours, lrs, betas=betas, eps=1e-15)
    ref = {k: torch.nn.Parameter(t.clone()) for k, t in start.items() if k != "colors"}
    ref["sh0"], ref["shN"] = (torch.nn.Parameter(start["colors"][:, :1].clone()),
                              torch.nn.Parameter(start["colors"][:, 1:].clone()))
    ref_lrs = {**{k: v for k, v in lrs.items() if k != "colors"}, "sh0": 2e-3, "shN": 1e-4}
    ref_opt = {k: torch.optim.Adam([p], lr=ref_lrs[k], betas=betas, eps=1e-15) for k, p in ref.items()}
    for it in range(6):
        grads = {k: torch.randn(*s, generator=g).to(device) for k, s in shapes.items()}
        if it == 3:
            grads["quats"] = None                                       # no gradient this step
        for k, grad in grads.items():
            ours[k].grad = None if grad is None else grad.clone()
        for k in ("means", "scales", "quats", "opacities"):
            ref[k].grad = None if grads[k] is None else grads[k].clone()
        ref["sh0"].grad, ref["shN"].grad = grads["colors"][:, :1].clone(), grads["colors"][:, 1:].clone()
        adam.step()
        adam.zero_grad()
        for opt in ref_opt.values():
            opt.step()
            opt.zero_grad()
        if it == 1:                                                     # a schedule changes a rate
            adam.views["means"].param_groups[0]["lr"] = 3e-4
            ref_opt["means"].param_groups[0]["lr"] = 3e-4
        assert all(p.grad is None for p in ours.values())
    for k in ("means", "scales", "opacities"):                          # float32, fused differently on CUDA
        torch.testing.assert_close(ours[k].detach(), ref[k].detach(), rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(adam.views[k].state[ours[k]]["exp_avg_sq"], ref_opt[k].state[ref[k]]["exp_avg_sq"],
                                   rtol=1e-4, atol=1e-7)                # float32, fused differently on CUDA
    torch.testing.assert_close(ours["colors"].detach(), torch.cat([ref["sh0"], ref["shN"]], 1).detach(),
                               rtol=1e-4, atol=1e-5)
    # the quats missed one step: its moments decayed once less than the shared count assumes, so only
    # check that it moved and stayed finite (torch's Adam keeps a count per parameter)
    assert torch.isfinite(ours["quats"]).all() and not torch.equal(ours["quats"].detach(), start["quats"])
    assert float(adam.views["means"].state[ours["means"]]["step"]) == 6


def test_shard_adam_follows_the_parameters_that_densification_replaces():
    """gsplat's ops swap a parameter and its moments in ``views``; the next step updates the new ones."""
    from gsplat.strategy.ops import duplicate

    from insitu.training.adam import ShardAdam

    params = {"means": torch.nn.Parameter(torch.zeros(4, 3)), "opacities": torch.nn.Parameter(torch.zeros(4))}
    adam = ShardAdam(params, {"means": 1e-2, "opacities": 1e-2})
    for p in params.values():
        p.grad = torch.ones_like(p)
    adam.step()
    duplicate(params, adam.views, {}, torch.tensor([True, False, False, True]))
    assert params["means"].shape == (6, 3) and adam.views["means"].param is params["means"]
    assert adam.views["means"].state[params["means"]]["exp_avg"].shape == (6, 3)
    before = params["means"].detach().clone()
    for p in params.values():
        p.grad = torch.ones_like(p)
    adam.step()
    assert (params["means"].detach() < before).all()


def test_halo_exchange_reaches_only_the_neighbouring_bands():
    """The SSIM halo's partners: with bands of >= 5 rows a rank trades with the bands above and
    below it only; bands shorter than 5 rows reach further, as far as 5 rows go."""
    from insitu.render.compositing import band_rows
    from insitu.training.bandloss import _halo_partners

    send, recv = _halo_partners(band_rows(100, 8), 3, 100)
    assert [q for q, f in enumerate(send) if f] == [q for q, f in enumerate(recv) if f] == [2, 4]
    send, recv = _halo_partners(band_rows(100, 8), 0, 100)
    assert [q for q, f in enumerate(send) if f] == [1]
    bands = band_rows(11, 5)                                            # bands of 3, 3, 3, 2 and 0 rows
    send, recv = _halo_partners(bands, 2, 11)                           # rows 6:9; its halo is 1:6 and 9:11
    assert [q for q, f in enumerate(recv) if f] == [0, 1, 3]
    assert [q for q, f in enumerate(send) if f] == [0, 1, 3, 4]         # the empty band's halo (6:11) too


# ------------------------------------------------------------------------------------------ per-iteration state

def test_visible_gradients_are_the_visible_views_pixel_gradient_norms(shard, block, scene, comm):
    trainer = make_trainer(shard, block, train_config(batch=3))
    train = scene.views.train_ids
    ids = train[:3]
    pred, info = render_bands(trainer.params, scene.views, ids, scene.order, comm, background=scene.background,
                              colors=ColorModel("sh", 0), backend="torch")
    pred.square().sum().backward()
    info["radii"] = info["radii"].clone()
    info["radii"][0, ::2] = 0                                       # culled in the first view: not counted
    grad2d, count = trainer._visible_gradients(info)
    g, vis = info["means2d"].grad, info["radii"] > 0                # [C, N, 2], [C, N]
    px = g * torch.tensor([scene.views.width / 2.0 * 3, scene.views.height / 2.0 * 3])
    want = torch.zeros(len(trainer))
    for c in range(3):                                              # one view at a time, visible ones only
        want[vis[c]] += px[c][vis[c]].norm(dim=-1)
    assert vis.any() and not vis.all()
    torch.testing.assert_close(grad2d, want)
    torch.testing.assert_close(count, vis.sum(0).float())


def test_densification_statistics_are_gathered_only_while_a_refine_lies_ahead(shard, block, scene, comm):
    """A refine at iteration it needs the statistics since the last one; after the last refine
    (densify.stop, or the schedule's end) the steps no longer gather them."""
    trainer = make_trainer(shard, block, train_config(densify=dict(start=0, every=2, stop=3, grad_threshold=1e9)),
                           total=100)
    gathered = []
    for it in range(5):
        before = float(trainer.state.count.sum())
        step(trainer, scene, comm, it)
        gathered.append(float(trainer.state.count.sum()) != before)
    assert gathered == [True, True, True, False, False]       # the refine at 2 zeroes them; none after 3
    late = make_trainer(shard, block, train_config(densify=dict(start=10**6)), total=100)
    step(late, scene, comm, 0)
    assert float(late.state.count.sum()) == 0                 # no refine before the schedule ends


def test_batches_cover_each_epoch_once_with_the_same_draws_every_time(scene):
    from insitu.training.sampling import ViewSampler

    tc = train_config(batch=2, seed=3)
    train = scene.views.train_ids
    per_epoch = len(train) // 2
    draws = [list(zip(range(2 * per_epoch), ViewSampler(scene, tc))) for _ in range(2)]
    first = torch.cat([ids for _, (ids, _) in draws[0][:per_epoch]])
    assert set(first.tolist()) <= set(train.tolist()) and len(first) == 2 * per_epoch
    assert len(set(first.tolist())) == len(first)                   # no view twice in an epoch
    for (_, (a, bg_a)), (_, (b, bg_b)) in zip(*draws):
        assert torch.equal(a, b) and torch.equal(bg_a, bg_b)        # reproducible: the same on every rank
        assert bg_a.shape == (2, 3) and 0 <= bg_a.min() and bg_a.max() <= 1
    fixed = next(iter(ViewSampler(scene, train_config(random_background=False))))[1]
    assert torch.equal(fixed, scene.background)


def test_footprint_errors_sum_blending_weights_and_their_error(shard, scene, comm):
    """Per pixel the Gaussians' blending weights sum to its alpha: so the weights summed over every
    Gaussian are the alpha summed over the images, and with the error map e the sums are alpha * e."""
    from insitu.training.trainer import to_params

    params = to_params(shard)
    ids = scene.views.train_ids[:3]
    pred, info = render_bands(params, scene.views, ids, scene.order, comm, background=scene.background,
                              colors=None if params["colors"].dim() == 2 else ColorModel("sh", 0), backend="torch")
    alpha = info["alpha"].detach()
    error = torch.rand(alpha.shape, generator=torch.Generator().manual_seed(3))
    sums = footprint_errors(params, scene.views, ids, scene.order, comm, error, backend="torch")
    assert sums.shape == (len(shard), 2) and float(sums[:, 1].min()) >= 0
    assert float(sums[:, 1].sum()) == pytest.approx(float(alpha.sum()), rel=1e-4)
    assert float(sums[:, 0].sum()) == pytest.approx(float((alpha * error).sum()), rel=1e-4)
    ones = footprint_errors(params, scene.views, ids, scene.order, comm, torch.ones_like(error), backend="torch")
    torch.testing.assert_close(ones[:, 0], ones[:, 1])

