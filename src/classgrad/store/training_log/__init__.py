"""The training log's store: a training run's per-class rows summed over windows of steps.

Holds nothing itself; its modules are ``log_store`` (``LogSpec``, ``open_log``, ``GradLogStore``,
``LogReader``, ``read_log``: what ``classgrad.workers.training.GradLog`` writes and the log
commands read) and ``log_records`` (each window's digests). Imports only the store's ``core``,
``integrity`` and ``rows``.
"""
