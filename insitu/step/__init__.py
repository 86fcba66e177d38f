"""Stage 7, one timestep end to end, and the sequence of them.

:mod:`.pipeline` (``compute_step``) runs the stages before it in order for one step (input checked, seeds,
scene, colours, training, evaluation, the model's colours fitted for viewers) and ``write_step`` hands the
result to a writer; :mod:`.layouts` chooses how the ranks share the training (sort-last or replicated),
:mod:`.metrics` scores the held-out views, :mod:`.compilation` compiles the step's Triton kernels ahead on
threads, and :mod:`.driver` trains a sequence of steps with warm starts. Takes a block, the configuration
and the communicator; gives a ``StepResult`` (the model, its images and figures).
"""
