"""Stage 4, drawing Gaussians: images of a shard from cameras, composited over the ranks.

:mod:`.rendering` rasterizes a shard for a batch of cameras (gsplat on CUDA, a torch reference that
follows its math elsewhere), :mod:`.shading` gives the colours a camera sees (spherical harmonics, the
coefficients' gradient kept factored), :mod:`.lighting` the headlight the ground truth is shaded with, and
:mod:`.compositing` composites the ranks' images sort-last, front to back, into row bands (autograd).
Takes Gaussians, cameras and the communicator; gives premultiplied images, or this rank's band of them.
"""
