"""Stage 8, what a run leaves on disk: the output folder, the step files, the report.

:mod:`.export` claims the output folder at a run's start and writes each step (:class:`~.export.StepWriter`:
:mod:`.ply`, the reference 3DGS model, :mod:`.webmodel`, its SPZ copy, and the images, tables and JSON of
:mod:`.files`, every file atomic); :mod:`.folder` names what the folder holds and locks it to one run;
:mod:`.report` writes ``report.html`` with the viewer of ``viewer/`` and serves it (``insitu view``). Takes
step results and the configuration; gives ``OUT/``.
"""
