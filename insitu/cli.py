"""Command line: ``insitu demo | run | replay | stream | view`` (also ``python -m insitu``).

Every command takes ``--config FILE`` (YAML), ``--set SECTION.KEY=VALUE`` overrides,
the common flags below, ``--out DIR`` and ``--help``. Run under ``mpiexec -n P`` (or
``srun``) to train on P ranks; a plain single process works too.
"""
from __future__ import annotations

import argparse
import signal
import sys
import threading
from typing import Any

from insitu import __version__
from insitu.config import Config, config_file_values, field_choices, load_config, parse_override, same_value
from insitu.errors import ConfigError, InputError, Terminated

EPILOG = """examples:
  insitu demo --out demo_out
  insitu run bonsai_256x256x256_uint8.raw --iso 40 --views 448 --resolution 1024 --out bonsai
  mpiexec -n 4 insitu replay gs.bp --var V --iso 0.3 --every 2 --out replay_out
  mpiexec -n 2 insitu stream gs_stream --var V --iso 0.3 --timeout 120 --out stream_out
  insitu view demo_out --port 8000      (serves the report: open the URL it prints)
"""


CONFIG_DEST = "config:"                  # a flag whose dest starts so sets the config key that follows
FLAG_NAMES: dict[str, dict[Any, str]] = {}  # config key -> {the flag's constant (None: takes a value): the flag}


def _config_flag(group, flag: str, key: str, **kwargs) -> None:
    """Add ``flag`` as an override of the config key ``key`` (``section.name``); its choices are the
    ones the config declares for the key."""
    FLAG_NAMES.setdefault(key, {})[kwargs.get("const")] = flag
    if kwargs.get("action") is None:           # a flag that takes a value
        choices = field_choices(key)
        if choices:
            kwargs["choices"] = list(choices)
        elif "metavar" not in kwargs:
            kwargs["metavar"] = flag.lstrip("-").replace("-", "_").upper()
    group.add_argument(flag, dest=CONFIG_DEST + key, **kwargs)


def _common(p: argparse.ArgumentParser, defaults: Config, *, fields: bool = True, iso_needed: bool = True,
            series: bool = True) -> None:
    """The flags of every training command. ``defaults``: the command's configuration (the help shows its
    values); ``fields``: its input holds named fields (``--var``, ``--color-var``); ``iso_needed``: the
    command takes no iso value by default; ``series``: it trains a series of steps (warm starts)."""
    g = p.add_argument_group("configuration (flags override the config file)")
    g.add_argument("--config", metavar="FILE", help="YAML configuration file")
    g.add_argument("--set", metavar="SECTION.KEY=VALUE", action="append", default=[],
                   help="override any config key, e.g. --set train.sh_degree=1 (repeatable)")
    _config_flag(g, "--out", "output.dir", metavar="DIR",
                 help="output directory (default: output.dir of the config, 'out')")
    _config_flag(g, "--iso", "input.iso", type=float, nargs="+", metavar="V",
                 help="iso value(s) (required)" if iso_needed
                 else f"iso value(s) (default {' '.join(f'{v:g}' for v in defaults.input.iso)})")
    _config_flag(g, "--var", "input.var",              # (taken without fields too, to be refused saying why)
                 help=f"name of the field to extract isosurfaces from (default {defaults.input.var})" if fields
                 else argparse.SUPPRESS)
    _config_flag(g, "--color-var", "input.color_var",
                 help="second field that colours the surface" if fields else argparse.SUPPRESS)
    views, train = defaults.views, defaults.train          # the defaults the help names
    _config_flag(g, "--views", "views.count", type=int, metavar="N",
                 help=f"number of orbit views (default {views.count})")
    _config_flag(g, "--resolution", "views.resolution", type=int, metavar="PX",
                 help=f"image width and height in pixels (default {views.resolution})")
    _config_flag(g, "--iterations", "train.iterations", type=int, metavar="N",
                 help=f"optimiser steps per timestep, each of --batch views (default {train.iterations}"
                      + (f"; from {defaults.series.warm_iterations} for a step warm-started from the previous one, "
                         "by the share of its surface that is new)"
                         if series and defaults.series.warm_start else ")"))
    _config_flag(g, "--budget", "seeds.budget", type=int, metavar="N",
                 help=f"Gaussians at initialisation, over all ranks, at most (default {defaults.seeds.budget})")
    _config_flag(g, "--batch", "train.batch", type=int, metavar="B",
                 help=f"views per optimiser step (default {train.batch})")
    _config_flag(g, "--psnr-target", "train.psnr_target", type=float, metavar="DB",
                 help="stop a step early at this held-out PSNR")
    _config_flag(g, "--ssim-target", "train.ssim_target", type=float, metavar="S", help="... and at this held-out SSIM")
    _config_flag(g, "--device", "run.device", help="training device")
    _config_flag(g, "--backend", "run.backend", help="rasterizer")
    _config_flag(g, "--quiet", "run.progress", action="store_const", const=False, help="no progress bars")
    g = p.add_argument_group("an output folder that holds results (default: refuse to use it)")
    g = g.add_mutually_exclusive_group()
    _config_flag(g, "--resume", "output.existing", action="store_const", const="resume",
                 help="keep its complete steps and train only the others (after a crash or a killed job)")
    _config_flag(g, "--overwrite", "output.existing", action="store_const", const="overwrite",
                 help="delete its results first")


def demo_config() -> Config:
    """The demo's configuration on a CPU (what ``insitu demo --help`` shows)."""
    from insitu.run.demo import demo_defaults  # the demo's modules only for the demo

    return load_config(None, None, demo_defaults(gpu=False))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="insitu", description="Gaussian splat models of isosurfaces of (running) simulations, on many ranks.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"insitu-gs {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = sub.add_parser("demo", help="run a small Gray-Scott simulation and train on it, in situ (no data needed)",
                       description="Runs the Gray-Scott mini-app in this process and trains a splat model of the "
                                   "isosurface of V every plotgap steps, in the background.")
    p.add_argument("--L", type=int, help="grid size of the simulation, at least 4 (default 36; 128 with a CUDA GPU)")
    p.add_argument("--steps", type=int, help="simulation steps, at least 1 (default 600; 480 with a CUDA GPU)")
    p.add_argument("--plotgap", type=int, help="analyse every this many steps, at least 1 (default 300; 80 with a "
                                               "CUDA GPU)")
    p.epilog = ("The defaults shown are the demo's on a CPU; with a CUDA GPU it sizes itself for it: 96 views of "
                "512 px, 3000 iterations, 1000 for each warm-started step.")
    _common(p, demo_config(), fields=False, iso_needed=False)

    p = sub.add_parser("run", help="train on one volume: a raw file (NAME_XxYxZ_uint8.raw) or a .npy array",
                       description="Train a splat model of one 3D field read from a raw or .npy file.")
    p.add_argument("input", help="NAME_XxYxZ_DTYPE.raw (Open SciVis naming) or FILE.npy ([nz, ny, nx])")
    _config_flag(p, "--dims", "input.dims", type=int, nargs=3, metavar=("X", "Y", "Z"), help="raw file dimensions")
    _config_flag(p, "--dtype", "input.dtype", help="raw file dtype (e.g. uint8, float32)")
    _config_flag(p, "--downsample", "input.downsample", type=int, metavar="K",
                 help="box-filter the volume by K per axis")
    p.add_argument("--spacing", type=float, nargs=3, metavar=("DX", "DY", "DZ"), default=(1.0, 1.0, 1.0),
                   help="world size of a cell along x, y, z, in the data's unit (default 1 1 1; model.ply is "
                        "written in it)")
    _common(p, Config(), fields=False, series=False)

    p = sub.add_parser("replay", help="train on the steps of a saved ADIOS2 BP file",
                       description="Replay an ADIOS2 BP file step by step; each rank reads only its block.")
    p.add_argument("input", help="BP file/directory written by the simulation")
    _config_flag(p, "--steps", "input.steps", type=int, nargs="+", metavar="S", help="only these step numbers")
    _config_flag(p, "--every", "input.every", type=int, metavar="K", help="train every K-th step")
    _common(p, Config())

    p = sub.add_parser("view", help="serve an output folder's report on localhost (open the URL it prints)",
                       description="Serve OUT (report.html, models, images) over HTTP on localhost, which the "
                                   "report's 3D viewer needs; from a login node, open it through an SSH tunnel.")
    p.add_argument("out", metavar="OUT", help="output folder of a run (holds report.html)")
    p.add_argument("--port", type=int, default=8000, help="port on localhost (default 8000; 0: any free port)")

    p = sub.add_parser("stream", help="train on steps as a running simulation sends them (ADIOS2 SST)",
                       description="Connect to a simulation writing through the ADIOS2 SST engine.")
    p.add_argument("input", help="SST stream name (the writer's file name)")
    _config_flag(p, "--every", "input.every", type=int, metavar="K", help="train every K-th step")
    _config_flag(p, "--timeout", "input.timeout_s", type=float, metavar="S",
                 help=f"give up when no step comes for S seconds (default {Config().input.timeout_s:g})")
    _common(p, Config())
    return parser


def _flag_text(key: str, value: Any) -> str:
    """How the command line gave ``key`` the ``value`` by a flag: ``--iterations 10``, ``--quiet``."""
    names = FLAG_NAMES.get(key, {})
    for const, flag in names.items():           # a flag that stores a constant (--quiet, --resume)
        if const is not None and type(const) is type(value) and const == value:
            return flag
    shown = " ".join(map(str, value)) if isinstance(value, list) else value
    return f"{names.get(None, '--set ' + key)} {shown}"


def command_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The configuration keys the command line sets, by flags and ``--set``; a ConfigError when a flag and ``--set``
    set one key to different values (``--iterations 10 --set train.iterations=20``), which would keep the flag's
    whatever their order. Of two ``--set`` of one key the later wins, as of two flags (scripts add to a base)."""
    given: dict[str, tuple[str, Any]] = {}      # key -> (how it was given, value)
    for text in args.set:
        key, value = parse_override(text)
        given[key] = (f"--set {text}", value)
    for dest, value in vars(args).items():
        if not dest.startswith(CONFIG_DEST) or value is None:
            continue
        key = dest[len(CONFIG_DEST):]
        flag = _flag_text(key, value)
        if key in given and not same_value(key, given[key][1], value):
            raise ConfigError(f"{key}: set twice, by {flag} and by {given[key][0]}; give one of them")
        given[key] = (flag, value)
    return {key: value for key, (_, value) in given.items()}


def config_from_args(args: argparse.Namespace) -> Config:
    defaults = None
    if args.command == "demo":
        from insitu.run.demo import check_demo_args, demo_defaults  # the demo's modules only for the demo

        check_demo_args(args)
        defaults = demo_defaults(gpu=False)
    # a flag never hides an invalid value for its key: the --set values checked first, over the flags' others
    # (checks across keys, such as train.min_scale_px against views.resolution, see the flags' values)
    flags = {dest[len(CONFIG_DEST):]: value for dest, value in vars(args).items()
             if dest.startswith(CONFIG_DEST) and value is not None}
    load_config(args.config, {**flags, **dict(parse_override(s) for s in args.set)}, defaults, keep_null=True)
    overrides = command_overrides(args)         # ... then two values for one key refused
    if args.command == "demo" and load_config(args.config, overrides, defaults, keep_null=True).run.device != "cpu":
        import torch                            # seconds to import: only to size the demo

        if torch.cuda.is_available():                   # the demo's sizes for a GPU
            defaults = demo_defaults(gpu=True)
    return load_config(args.config, overrides, defaults, keep_null=True)


def iso_given(args: argparse.Namespace) -> bool:
    """Whether ``input.iso`` comes from the command line (``--iso``, ``--set input.iso=...``) or the config file,
    rather than the configuration's default (meant for the Gray-Scott demo's field, meaningless for another)."""
    if command_overrides(args).get("input.iso") is not None:
        return True
    section = config_file_values(args.config).get("input")
    return isinstance(section, dict) and section.get("iso") is not None


def _terminated(signum, frame) -> None:
    raise Terminated()


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _terminated)     # SIGTERM (a job's time limit) ends a run as Ctrl-C does
    if args.command == "view":
        from insitu.output.report import serve  # the report server needs no analysis modules

        return serve(args.out, args.port)
    from insitu.run.runner import run_command   # after parsing: `--help` answers without it

    try:
        cfg = config_from_args(args)
        args.iso_given = args.command == "demo" or iso_given(args)   # the demo's iso is its own
        return run_command(args, cfg)
    except (ConfigError, InputError) as e:
        print(f"insitu: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:              # (a run's own is answered by run_command, saying what it kept)
        terminated = isinstance(e, Terminated)
        print(f"insitu: interrupted ({'SIGTERM' if terminated else 'SIGINT'})", file=sys.stderr)
        return 143 if terminated else 130


if __name__ == "__main__":
    sys.exit(main())
