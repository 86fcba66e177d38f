"""The one step driver behind ``insitu run/replay/stream`` and the Adaptor: its warm-start rule."""
from insitu.config import from_dict
from insitu.step.driver import StepDriver


class Recorder:
    def __init__(self):
        self.calls = []

    def __call__(self, block, cfg, comm, *, step, time, writer, warm, iterations):
        self.calls.append((step, warm, iterations, writer))
        return f"result {step}"


def driver(**series):
    cfg = from_dict({"train": {"iterations": 20}, "series": {"warm_iterations": 7, "warm_start": True, **series}})
    process = Recorder()
    return StepDriver(cfg, comm=None, writer="w", process=process), process


def test_warm_start_follows_the_recorded_step_and_is_bounded_by_train_iterations():
    d, p = driver()
    d.trained(d.train(None, step=0, time=0.0))
    d.trained(d.train(None, step=1, time=1.0))
    d.train(None, step=2, time=2.0)                  # not recorded (it failed on a rank): no warm start from it
    d.train(None, step=3, time=3.0)
    assert p.calls == [(0, None, None, "w"), (1, "result 0", 7, "w"), (2, "result 1", 7, "w"), (3, "result 1", 7, "w")]
    d, p = driver(warm_iterations=50)
    d.trained(d.train(None, step=0, time=0.0))
    d.train(None, step=1, time=0.0)
    assert p.calls[1][1:3] == ("result 0", 20)


def test_forget_and_warm_start_off_start_cold():
    d, p = driver()
    d.trained(d.train(None, step=0, time=0.0))
    d.forget()
    d.train(None, step=1, time=0.0)
    assert p.calls[1][1:3] == (None, None)
    d, p = driver(warm_start=False)                 # the previous step is given (its time budget), not warm
    d.trained(d.train(None, step=0, time=0.0))
    d.train(None, step=1, time=0.0)
    assert p.calls[1][1:3] == ("result 0", None)


def test_a_warm_step_with_a_quality_target_trains_until_it_meets_it():
    """With a target looked at during training, a warm step may take train.iterations (the target or the time
    budget ends it sooner); a target never looked at (train.eval_every 0) cannot, so the warm iterations hold."""
    for train, want in (({"psnr_target": 30.0, "eval_every": 5}, 20), ({"ssim_target": 0.9, "eval_every": 5}, 20),
                        ({"psnr_target": 30.0}, 7), ({"time_budget_s": 5.0}, 7)):
        cfg = from_dict({"train": {"iterations": 20, **train}, "series": {"warm_iterations": 7, "warm_start": True}})
        process = Recorder()
        d = StepDriver(cfg, comm=None, process=process)
        d.trained(d.train(None, step=0, time=0.0))
        d.train(None, step=1, time=1.0)
        assert [c[2] for c in process.calls] == [None, want], train


def test_a_warm_step_trains_more_by_its_share_of_new_seeds():
    """series.follow_iterations: the warm iterations for an unchanged surface, a cold step's for a wholly new
    one, in proportion between (rounded); off, or a step already at train.iterations (a quality target), as
    given."""
    from insitu.step.driver import follow_iterations

    cfg = from_dict({"train": {"iterations": 1500}, "series": {"warm_iterations": 250, "follow_iterations": True}})
    assert [follow_iterations(cfg, 250, new, 1000) for new in (0, 250, 600, 1000)] == [250, 562, 1000, 1500]
    assert follow_iterations(cfg, 250, 5, 0) == 250                     # nothing to train: as given
    assert follow_iterations(cfg, 1500, 600, 1000) == 1500              # a target's cap: as given
    off = from_dict({"train": {"iterations": 1500}, "series": {"warm_iterations": 250, "follow_iterations": False}})
    assert follow_iterations(off, 250, 600, 1000) == 250


def test_a_warm_steps_training_budget_is_what_its_seconds_leave():
    """series.step_seconds: less the step's seconds so far and what the previous step took after training
    (total less seeds, ground truth and training, plus writing); never below 0; the tighter of it and
    train.time_budget_s; a cold step (no previous metrics) or no step_seconds: train.time_budget_s alone."""
    from insitu.step.driver import training_budget

    previous = {"total_seconds": 20.0, "seeds_seconds": 1.0, "ground_truth_seconds": 3.0, "train_seconds": 12.0,
                "model_write_seconds": 0.5, "export_seconds": 1.5}            # 4 s after training, 2 s writing
    cfg = from_dict({"series": {"step_seconds": 10.0}})
    assert training_budget(cfg, previous, 1.0) == 10.0 - 1.0 - 6.0
    assert training_budget(cfg, previous, 9.0) == 0.0
    assert training_budget(cfg, None, 1.0) is None
    both = from_dict({"series": {"step_seconds": 10.0}, "train": {"time_budget_s": 2.0}})
    assert training_budget(both, previous, 1.0) == 2.0 and training_budget(both, None, 1.0) == 2.0
    assert training_budget(from_dict({}), previous, 1.0) is None
