"""The analysis stores: what the analysis commands write beside a job's rows, or on their own.

Holds nothing itself; its modules are ``similarity_arrays`` (``classgrad similarity``'s results
in the job's store) with ``result_records`` (their digests), ``preconditioner`` (``classgrad
score``'s saved Gram matrix) and ``score_output`` (the store ``classgrad score --out`` writes).
Imports only the store's ``core``, ``integrity`` and ``rows``.
"""
