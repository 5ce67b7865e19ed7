"""The training log's store: a training run's per-class rows summed over windows of steps.

Holds nothing itself; its modules are ``log_store`` (``LogSpec``, ``open_log``, ``GradLogStore``,
``LogReader``, ``read_log``: what ``classgrad.workers.training.GradLog`` writes and the log
commands read), ``log_records`` (each window's digests), ``row_shards`` (a window's sums stored
as the rows of the classes it saw) and ``log_dataset`` (``open_log_dataset``: the done windows as
a lazy xarray Dataset, every block checked). Imports only the store's ``core``,
``integrity`` and ``rows``.
"""
