"""The project's Python mini-apps, installed beside ``insitu`` under a name of the project's own.

``insitu_sims.gray_scott``: the 3D Gray-Scott reaction-diffusion mini-app on mpi4py, writing
through ADIOS2 (``python -m insitu_sims.gray_scott --help``; ``--preset breakup``: rates that ramp so the
pattern changes character); ``insitu demo`` runs it in situ. ``insitu_sims.heat``: a heat equation with
sources on circular orbits, whose isosurfaces grow, move, merge and split (``python -m insitu_sims.heat
--help``). ``insitu_sims.grid``: what they share (the grid split over the ranks, the ghost exchange, the
ADIOS2 output that ``insitu replay`` and ``insitu stream`` read).
The mini-apps are standalone simulations: they do not import ``insitu``.
"""
