"""Stage 5, what a model must match: the step's views and their ground-truth images.

:mod:`.views` places the cameras (an orbit, close-ups, the held-out sets off the orbit); :mod:`.caster`
ray-casts a block's isosurface straight from its trilinear field (inputs checked, then :mod:`.torch_caster`,
the reference, or :mod:`.triton_caster`, one kernel, over what :mod:`.field` prepares once, coloured
through :mod:`.colormaps`); :mod:`.scene` makes a step's :class:`~.scene.Scene`: the views, their
visibility order and this rank's band of every view's ground truth, composited sort-last. Takes a block,
the configuration and the communicator; gives the scene that training fits and evaluation scores.
"""
