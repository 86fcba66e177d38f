"""Stage 6, fitting a shard to the ground truth: the optimiser's iterations.

:mod:`.trainer` (:class:`~.trainer.Trainer`): render the shard for a batch of views, composite over the
ranks, the band's loss (:mod:`.bandloss`: the pixel term and D-SSIM, :mod:`.ssim`, whose windows reach
into the neighbouring bands), an optimiser step (:mod:`.adam`, over the shard's parameters at once) and
densification; :mod:`.appearance` holds the colour models (lit or SH) and the SH fit of the written model,
:mod:`.sampling` draws each iteration's training views. Takes a scene and an initial shard; gives the
trained shard.
"""
