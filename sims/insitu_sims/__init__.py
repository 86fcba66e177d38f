"""The project's Python mini-apps, installed beside ``insitu`` under a name of the project's own.

``insitu_sims.gray_scott``: the 3D Gray-Scott reaction-diffusion mini-app on mpi4py, writing
through ADIOS2 (``python -m insitu_sims.gray_scott --help``); ``insitu demo`` runs it in situ.
The mini-apps are standalone simulations: they do not import ``insitu``.
"""
