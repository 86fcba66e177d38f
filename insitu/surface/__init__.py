"""Stage 3, the isosurface's first Gaussians: a block's seeds and the shard made of them.

:mod:`.seeds` runs marching cubes over the cells a rank owns (the ranks' surfaces tile the global one) and
turns the vertices into flat discs in the tangent plane, within the budget; :mod:`.gaussians` holds a
rank's shard (:class:`~.gaussians.Gaussians`, parameters before activation, as 3DGS stores them), checks
it and gathers the shards. Takes a block and its iso values; gives this rank's initial shard.
"""
