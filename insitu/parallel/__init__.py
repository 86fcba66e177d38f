"""Stage 1, the ranks: the communicator every later stage is collective over.

:mod:`.comm` builds it from an MPI communicator (``init_comm``: a ``torch.distributed`` process group over
the same processes, gloo on CPUs, NCCL on GPUs, one device per rank) and gives :class:`~.comm.Comm`: phases
whose failures every rank sees, tensor collectives, sub-communicators; :mod:`.agreement` is how the ranks
take one decision together (errors, timeouts, configurations), so that a failure on one rank never leaves
the others waiting in a collective. Takes the ``parallel`` settings and an MPI communicator; gives the
``Comm`` the input, the step and the outputs run over.
"""
