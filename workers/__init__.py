"""classgrad's compute side, imported as ``classgrad.workers``.

Holds the compute layer at this level: loss kinds (``losses``), AMP scaling (``amp``), parameter
layout (``layout``), probe batches (``probe``), projection, import helpers and the model zoo,
with the gradient engines in ``engines``. The Ray actor, the row writer and the job factory are
the runtime layer above it, in ``actor_runtime``.
"""
