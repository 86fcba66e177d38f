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
    ("train:\n  backend: vulkan\n", "train.backend: expected one of auto, gsplat, torch, got 'vulkan'"),
    ("input:\n  iso: []\n", "input.iso: expected at least one iso value"),
    ("train:\n  progress: 3\n", "expected true or false"),
    ("parallel:\n  threads: -1\n", "parallel.threads: expected a value >= 0, got -1"),
    ("- a\n- b\n", "expected a mapping of sections"),
    ("views:\n  march_step: 2\n", "views.march_step: expected a step in (0, 1] cells"),
    ("seeds:\n  fill: true\n", "seeds.fill: true starts at seeds.budget (2000000) whatever the surface's size, and "
     "seeds.density=4 asks for that many Gaussians per pixel of it: set seeds.density=0 with seeds.fill=true"),
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
    appears in both; the example sets every key and loads as the defaults."""
    import dataclasses
    import re
    import typing
    from pathlib import Path

    from insitu.config import GENERATED, config_file_values

    root = Path(__file__).resolve().parents[1]
    for name, write in GENERATED.items():
        assert (root / name).read_text(encoding="utf-8") == write(), f"{name} is stale: run python -m insitu.config"
    example = root / "examples" / "config.yaml"
    values, reference = config_file_values(example), (root / "docs" / "configuration.md").read_text()
    for section, cls in typing.get_type_hints(Config).items():
        names = [f.name for f in dataclasses.fields(cls)]
        assert list(values[section]) == names, section
        for f in dataclasses.fields(cls):
            doc = f.metadata.get("doc") or ""
            assert len(doc.split()) >= 3 and not re.search(r"\bruns? \d|BENCHMARKS", doc), (section, f.name, doc)
            assert reference.count(f"| `{section}.{f.name}` |") == 1, (section, f.name)
    assert load_config(example).to_dict() == Config().to_dict()


def test_missing_file_and_bad_override(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match="SECTION.KEY=VALUE"):
        parse_override("iterations=5")
    assert parse_override("train.lr_means=1e-4") == ("train.lr_means", 1e-4)


def test_every_declared_constraint_is_checked_under_its_own_key():
    import dataclasses
    import typing

    from insitu.config import FRACTION, NON_NEGATIVE, OPEN_FRACTION, POSITIVE, Config, from_dict

    checked = 0
    for section, cls in typing.get_type_hints(Config).items():
        for f in dataclasses.fields(cls):
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
                with pytest.raises(ConfigError, match=f"^{section}\\.{f.name}: {message}"):
                    from_dict({section: {f.name: value}})
                checked += 1
    assert checked >= 40          # the constraints of the sections (renaming a field keeps its own)


def test_memory_estimate_of_the_replicated_layout_holds_whole_images_and_the_whole_model():
    from insitu.config import memory_estimate

    cfg = Config()
    cfg.views.count, cfg.views.resolution, cfg.seeds.fill, cfg.seeds.budget = 10, 100, True, 1000
    cfg.train.batch = 1                                                       # one view per step (then 3, below)
    sort_last = memory_estimate(cfg, ranks=2)
    cfg.parallel.layout = "replicated"
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
