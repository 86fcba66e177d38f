"""Stage 7, one timestep end to end, and the sequence of them.

:mod:`.pipeline` (``compute_step``) runs the stages before it in order for one step and ``write_step`` hands the
result to a writer; each phase is a module of its own: :mod:`.seeding` (the initial shard: seeds, or a warm
start's shard refit, and their colours), :mod:`.loop` (the trainer's training loop, watched), :mod:`.evaluation`
(the held-out figures, and the metrics' import on a thread), :mod:`.plyfit` (``model.ply``'s colours fitted for
viewers) and :mod:`.clock` (the phases' seconds). :mod:`.layouts` chooses how the ranks share the training
(sort-last or replicated), :mod:`.metrics` scores images, :mod:`.compilation` compiles the step's Triton kernels
ahead on threads, and :mod:`.driver` trains a sequence of steps with warm starts. Takes a block, the configuration
and the communicator; gives a ``StepResult`` (the model, its images and figures).
"""
