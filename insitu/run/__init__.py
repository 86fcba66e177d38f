"""Stage 9, runs: a source's steps or a simulation's, from start to end.

:mod:`.runner` is the body of ``insitu run | replay | stream``: the input checked on every rank before the
output folder is claimed, the source's steps trained and written, ``--resume``; :mod:`.adaptor`
(:class:`~.adaptor.Adaptor`) links the analysis into a running simulation (each ``execute`` trained at
once or on a worker thread, a queue of steps); :mod:`.demo` runs the Gray-Scott mini-app with an Adaptor.
Takes a configuration and a source, or a simulation's calls; gives an output folder. ``insitu.cli``, the
command line, parses its arguments and calls them.
"""
