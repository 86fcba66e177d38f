"""Stage 2, a timestep's field: where it comes from, read into this rank's block.

:mod:`.sources` opens a source (an in-memory array, raw volume files, an ADIOS2 BP file or SST stream) and
yields, step after step, this rank's :class:`insitu.volume.Block` (the field with its ghost layer, checked);
:mod:`.decomposition` cuts the global grid into blocks, :mod:`.bpfile` checks BP files before ADIOS2 reads
them and probes their steps, :mod:`.conventions` reads what other writers record besides the samples (step
numbers, times, origin and spacing). Takes the ``input`` settings and the communicator; gives a block per
rank and step, with its step number and time.
"""
