import pytest

from insitu.config import Config, load_config, parse_override
from insitu.errors import ConfigError


def test_defaults_are_valid():
    cfg = load_config()
    assert cfg.views.count == 448 and cfg.input.iso == [0.25]


def test_yaml_file_and_overrides(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("input:\n  var: V\n  iso: 0.3\ntrain:\n  iterations: 50\n")
    cfg = load_config(f, {"train.iterations": 7, "views.resolution": 32})
    assert cfg.input.var == "V" and cfg.input.iso == [0.3]
    assert cfg.train.iterations == 7 and cfg.views.resolution == 32


def test_defaults_sit_under_the_file(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("views:\n  count: 12\n")
    cfg = load_config(f, {}, defaults={"views.count": 5, "views.resolution": 40})
    assert cfg.views.count == 12 and cfg.views.resolution == 40


@pytest.mark.parametrize("text, message", [
    ("train:\n  iteratons: 5\n", "unknown key(s) iteratons"),
    ("trian:\n  iterations: 5\n", "unknown section(s) trian"),
    ("train:\n  iterations: many\n", "train.iterations: expected an integer, got str 'many'"),
    ("views:\n  resolution: 0\n", "views.resolution: expected a value > 0, got 0"),
    ("views:\n  count: -3\n", "views.count: expected a value > 0, got -3"),
    ("run:\n  backend: vulkan\n", "run.backend: expected one of auto, gsplat, torch, got 'vulkan'"),
    ("input:\n  iso: []\n", "input.iso: expected at least one iso value"),
    ("run:\n  progress: 3\n", "expected true or false"),
    ("run:\n  threads: -1\n", "run.threads: expected a value >= 0, got -1"),
    ("train:\n  densify:\n    start: -1\n", "train.densify.start: expected a value >= 0, got -1"),
    ("train:\n  densify:\n    begin: 5\n", "train.densify: unknown key(s) begin; expected some of every, "),
    ("train:\n  densify: 5\n", "train.densify: expected a mapping of keys, got int 5"),
    ("- a\n- b\n", "expected a mapping of sections"),
    ("views:\n  march_step: 2\n", "views.march_step: expected a step in (0, 1] cells"),
    ("seeds:\n  fill: true\n", "seeds.fill: true starts at seeds.budget (2000000) whatever the surface's size, and "
     "seeds.density=4 asks for that many Gaussians per pixel of it: set seeds.density=0 with seeds.fill=true"),
    # YAML would read these silently: keys given twice, null for a key that needs a value, beyond 64 bits
    ("train: {iterations: 5, iterations: 7}\n",
     "key train.iterations appears twice (lines 1 and 1); YAML would keep only the second: give it once"),
    ("train:\n  iterations: 5\nviews:\n  count: 9\ntrain:\n  batch: 2\n",
     "section train appears twice (lines 1 and 5); YAML would keep only the second: merge them into one"),
    ("train:\n  densify:\n    start: 1\n    every: 2\n    start: 3\n",
     "key train.densify.start appears twice (lines 3 and 5)"),
    ("input:\n  var: null\n", "input.var: expected a string, got null"),
    ("train:\n  iterations: 99999999999999999999999999\n",
     "train.iterations: expected an integer of 64 bits (at most 2**63 - 1 = 9223372036854775807), got "
     "99999999999999999999999999"),
    ("seeds:\n  budget: -100000000000000000000000000000\n", "seeds.budget: expected an integer of 64 bits"),
])
def test_bad_config_names_the_problem(tmp_path, text, message):
    f = tmp_path / "c.yaml"
    f.write_text(text)
    with pytest.raises(ConfigError) as e:
        load_config(f)
    assert message in str(e.value)


def test_seeds_come_by_density_or_with_a_density_of_0_as_fill_says():
    """seeds.density > 0: that many per pixel, points on the triangles; 0: the budget, as points on the
    triangles with seeds.fill, else as the marching-cubes vertices."""
    from insitu.step.seeding import seed_count, seeds_fill

    budget = 1000
    fill = load_config(None, {"seeds.budget": budget, "seeds.density": 0, "seeds.fill": True})
    vertices = load_config(None, {"seeds.budget": budget, "seeds.density": 0})
    assert seeds_fill(fill) and not seeds_fill(vertices) and seeds_fill(load_config())
    assert seed_count(fill, 1.0, None) == seed_count(vertices, 1.0, None) == budget


def test_the_example_config_and_the_reference_are_generated_from_the_dataclasses():
    """examples/config.yaml and docs/configuration.md are what insitu/config.py writes from each key's field
    (after changing a key: python -m insitu.config); every key has its doc, citing no benchmark run, and
    appears in both (a nested section's keys in its own block and table); the example sets every key and loads
    as the defaults."""
    import dataclasses
    import re
    from pathlib import Path

    from insitu.config import GENERATED, config_file_values, config_keys, config_sections, config_value

    root = Path(__file__).resolve().parents[1]
    for name, write in GENERATED.items():
        assert (root / name).read_text(encoding="utf-8") == write(), f"{name} is stale: run python -m insitu.config"
    example = root / "examples" / "config.yaml"
    values, reference = config_file_values(example), (root / "docs" / "configuration.md").read_text()
    for section, cls in config_sections().items():
        assert list(config_value(values, section)) == [f.name for f in dataclasses.fields(cls)], section
        heading = "###" if "." in section else "##"                       # a nested section: a table of its own
        assert len(cls.__doc__.split()) >= 3 and reference.count(f"\n{heading} {section}\n") == 1, section
    assert "train.densify" in config_sections()
    for key, (f, _) in config_keys().items():
        doc = f.metadata.get("doc") or ""
        assert len(doc.split()) >= 3 and not re.search(r"\bruns? \d|BENCHMARKS", doc), (key, doc)
        assert reference.count(f"| `{key}` |") == 1, key
    assert load_config(example).to_dict() == Config().to_dict()


def test_the_cpu_example_is_the_cpu_demo_s_training():
    """examples/cpu.yaml (the README's first run on a CPU) holds the CPU demo's settings of what a step computes
    (views, seeds, train, output: insitu/run/demo.py), no other key, and loads."""
    from pathlib import Path

    from insitu.config import config_file_values
    from insitu.run.demo import demo_defaults

    path = Path(__file__).resolve().parents[1] / "examples" / "cpu.yaml"

    def flat(values: dict, prefix: str = "") -> dict:
        out = {}
        for key, value in values.items():
            out.update(flat(value, f"{prefix}{key}.") if isinstance(value, dict) else {f"{prefix}{key}": value})
        return out

    example = flat(config_file_values(path))
    demo = {k: v for k, v in demo_defaults(gpu=False).items() if k.split(".")[0] in ("views", "seeds", "train", "output")}
    assert example == demo
    cfg = load_config(path)
    assert (cfg.views.resolution, cfg.train.batch, cfg.train.antialiased) == (96, 1, False)


def test_missing_file_and_bad_override(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match="SECTION.KEY=VALUE"):
        parse_override("iterations=5")
    assert parse_override("train.lr_means=1e-4") == ("train.lr_means", 1e-4)


def test_every_declared_constraint_is_checked_under_its_own_key():
    import re

    from insitu.config import FRACTION, NON_NEGATIVE, OPEN_FRACTION, POSITIVE, config_keys, from_dict, merge

    checked = 0
    for key, (f, _) in config_keys().items():
        checks, choices = f.metadata.get("checks", ()), f.metadata.get("choices")
        below, at_most = f.metadata.get("below"), f.metadata.get("at_most")
        bad = ([("nope", "expected one of")] if choices else []) + \
              ([(-1, "expected a value > 0")] if POSITIVE in checks else []) + \
              ([(-1, "expected a value >= 0")] if NON_NEGATIVE in checks else []) + \
              ([(2, "expected a value in [\\[(]0, 1\\]")] if FRACTION in checks else []) + \
              ([(1, "expected a value in \\(0, 1\\)")] if OPEN_FRACTION in checks else []) + \
              ([(below[0], "expected a value < ")] if below else []) + \
              ([(at_most[0] * 2, "expected a value <= ")] if at_most else [])
        for value, message in bad:
            with pytest.raises(ConfigError, match=f"^{re.escape(key)}: {message}"):
                from_dict(merge({}, {key: value}))
            checked += 1
    assert checked >= 40          # the constraints of the sections (renaming a field keeps its own)


def test_memory_estimate_of_the_replicated_layout_holds_whole_images_and_the_whole_model():
    from insitu.config import memory_estimate

    cfg = Config()
    cfg.views.count, cfg.views.resolution, cfg.seeds.fill, cfg.seeds.budget = 10, 100, True, 1000
    cfg.train.batch = 1                                                       # one view per step (then 3, below)
    sort_last = memory_estimate(cfg, ranks=2)
    cfg.run.layout = "replicated"
    replicated, one = memory_estimate(cfg, ranks=2), memory_estimate(cfg, ranks=1)
    assert sort_last["ground_truth"] == 10 * 50 * 100 * 4 * 2                 # a band of every view (RGBA)
    assert replicated["ground_truth"] == 10 * (50 + 100) * 100 * 4 * 2        # the band, then the whole views
    assert one["gaussians"] == 2 * sort_last["gaussians"]
    assert replicated["gaussians"] == one["gaussians"] + 1000 * 48 * 4       # the SH gradient written out
    assert sort_last["loss"] == (50 + 10) * 100 * 24 * 4                       # SSIM planes: band and halo
    assert replicated["loss"] == one["loss"] == 100 * 100 * 24 * 4            # the whole view
    assert sort_last["pixel_term"] == 50 * 100 * 13 * 4                        # the squared error's, on the band
    assert replicated["pixel_term"] == one["pixel_term"] == 100 * 100 * 13 * 4
    assert one == memory_estimate(Config(views=cfg.views, seeds=cfg.seeds, train=cfg.train),
                                  ranks=1)                                    # one rank: no replicas
    cfg.train.batch = 3                                                       # the SH factors of every view
    assert memory_estimate(cfg, ranks=1)["gaussians"] == one["gaussians"] + 2 * 1000 * 37 * 4


def test_a_nested_sections_keys_come_from_the_file_the_defaults_and_set_alike(tmp_path):
    """train.densify's keys: each one's own value from a YAML block, --set (three-level keys) or a command's
    defaults, the rest kept, each source over the one below key by key; compared and hashed as nested keys."""
    from insitu.config import config_differences, config_hash, config_value, parse_override

    f = tmp_path / "c.yaml"
    f.write_text("train:\n  iterations: 9\n  densify:\n    start: 7\n    every: 3\n")
    key, value = parse_override("train.densify.every=5")
    cfg = load_config(f, {key: value}, defaults={"train.densify.stop": 11, "train.densify.start": 1})
    d = cfg.train.densify
    assert (cfg.train.iterations, d.start, d.every, d.stop, d.reset_every) == (9, 7, 5, 11, 3000)
    values, default = cfg.to_dict(), Config().to_dict()
    assert config_value(values, "train.densify.every") == 5
    assert config_differences(default, values) == ["train.densify.every", "train.densify.start",
                                                   "train.densify.stop", "train.iterations"]
    assert config_hash(cfg) != config_hash(Config())
    assert load_config(None, {"train.densify.every": 5}).train.densify.start == 500
    with pytest.raises(ConfigError, match=r"^train.densify: expected a mapping of keys, got 3$"):
        load_config(None, {"train.densify": 3, "train.densify.start": 1})


@pytest.mark.parametrize("text, overrides, message", [   # (each line "# old key": the rename script leaves it)
    ("parallel:\n  device: cpu\n", {}, "config: parallel.device is now run.device"),  # old key
    ("train:\n  densify_from: 10\n  backend: torch\n", {},  # old key
     "config: train.densify_from is now train.densify.start; train.backend is now run.backend"),  # old key
    ("insitu:\n  mode: sync\n  warm_start: false\n", {},  # old key
     "config: insitu.mode is now run.mode; insitu.warm_start is now series.warm_start"),  # old key
    ("insitu: {}\n", {}, "config: insitu is now run and series"),  # old key
    (None, {"train.opacity_reset_every": 0},  # old key
     "config: train.opacity_reset_every is now train.densify.reset_every"),  # old key
    (None, {"parallel.layout": "replicated"}, "config: parallel.layout is now run.layout"),  # old key
    (None, {"insitu.warm_iterations": 5}, "config: insitu.warm_iterations is now series.warm_iterations"),  # old key
])
def test_a_key_that_moved_is_refused_naming_where_it_is_now(tmp_path, text, overrides, message):
    f = None
    if text is not None:
        f = tmp_path / "c.yaml"
        f.write_text(text)
    with pytest.raises(ConfigError) as e:
        load_config(f, overrides)
    assert str(e.value) == message


def test_every_moved_key_names_a_key_of_the_configuration_and_run_keys_are_keys():
    """MOVED's new places and RUN_KEYS (what a resumed run may change) name keys that exist; no old key does.
    The run section's keys that change the trained numbers are compared on resume."""
    from insitu.config import MOVED, RUN_KEYS, config_keys

    keys = config_keys()
    assert set(MOVED.values()) <= set(keys) and not set(MOVED) & set(keys)
    assert RUN_KEYS <= set(keys)
    assert {"run.backend", "run.layout", "run.transfer"}.isdisjoint(RUN_KEYS)
    assert {k for k in keys if k.startswith("run.")} - {"run.backend", "run.layout", "run.transfer"} <= RUN_KEYS


def test_a_step_config_written_before_the_keys_moved_reads_as_the_same_configuration(tmp_path):
    """A step folder's config.yaml from before the move (what --resume compares with) is read with its keys
    where they are now: the defaults written the old way are the defaults; a setting keeps its value."""
    import functools

    import yaml

    from insitu.config import MOVED, upgraded
    from insitu.output.export import kept_differences

    cfg = load_config(None, {"train.densify.start": 501})
    old = cfg.to_dict()                         # written the old way: every moved key back where it was
    added = [old["series"].pop(k)               # nor the keys that came after
             for k in ("follow_iterations", "step_seconds", "cold_above", "cold_every")]
    for was, now in MOVED.items():
        *path, name = now.split(".")
        section, key = was.split(".")
        old.setdefault(section, {})[key] = functools.reduce(dict.get, path, old).pop(name)
    assert old.pop("run") == old.pop("series") == old["train"].pop("densify") == {}
    assert set(old) == {"input", "seeds", "views", "train", "output", "parallel", "insitu"}

    want = cfg.to_dict()
    assert [want["series"].pop(k) for k in ("follow_iterations", "step_seconds", "cold_above", "cold_every")] == added
    assert upgraded(old) == want and old["train"]["densify_from"] == 501   # old key: left as it was
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(old))
    assert kept_differences(tmp_path, cfg, None) == []
    assert kept_differences(tmp_path, Config(), None) == ["train.densify.start (501 kept vs 500 now)"]


@pytest.mark.parametrize("args, message", [
    (["--iterations", "10", "--set", "train.iterations=20"],
     "train.iterations: set twice, by --iterations 10 and by --set train.iterations=20; give one of them"),
    (["--quiet", "--set", "run.progress=true"], "run.progress: set twice, by --quiet and by --set run.progress=true"),
    (["--resume", "--set", "output.existing=overwrite"],
     "output.existing: set twice, by --resume and by --set output.existing=overwrite"),
    (["--iso", "1", "2", "--set", "input.iso=[1, 3]"], "input.iso: set twice, by --iso 1.0 2.0 and by --set"),
    (["--set", "input.var=null"], "input.var: expected a string, got null"),
    (["--iterations", "99999999999999999999999999"], "train.iterations: expected an integer of 64 bits"),
    (["--set", "train.densify={start: 1, start: 2}"], "key train.densify.start appears twice (lines 1 and 1)"),
])
def test_two_values_for_one_key_on_the_command_line_are_refused(args, message):
    """A flag and --set that give one key different values: refused naming both, not the flag's taken without a
    word whatever their order; --set KEY=null sets null, which a key that needs a value refuses."""
    from insitu.cli import build_parser, config_from_args

    with pytest.raises(ConfigError) as e:
        config_from_args(build_parser().parse_args(["replay", "x.bp", *args]))
    assert message in str(e.value)


def test_the_same_value_twice_and_null_for_an_optional_key_are_taken(tmp_path):
    from insitu.cli import build_parser, config_from_args

    f = tmp_path / "c.yaml"
    f.write_text("input:\n  color_var: U\n")
    args = ["--config", str(f), "--iso", "1", "--set", "input.iso=1", "--iterations", "5",
            "--set", "train.iterations=5.0", "--set", "input.color_var=null", "--set", "train.batch=3",
            "--set", "train.batch=2"]                # of two --set, the later wins (a script adds to a base)
    cfg = config_from_args(build_parser().parse_args(["replay", "x.bp", *args]))
    assert cfg.input.iso == [1.0] and cfg.train.iterations == 5 and cfg.input.color_var is None
    assert cfg.train.batch == 2
    assert load_config(None, {"train.iterations": 2**63 - 1}).train.iterations == 2**63 - 1   # the bound passes
