"""insitu-gs: in situ 3D Gaussian splatting of isosurfaces for running MPI simulations.

Entry points: the ``insitu`` command (``insitu --help``), ``insitu.Adaptor`` for
simulations that link the analysis in, and ``insitu.step.pipeline.run_step`` for one step.
"""
__version__ = "0.1.0"


def __getattr__(name):
    if name == "Adaptor":
        from insitu.run.adaptor import Adaptor

        return Adaptor
    raise AttributeError(f"module 'insitu' has no attribute {name!r}")


__all__ = ["Adaptor", "__version__"]
