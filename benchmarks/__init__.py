"""Reproducible comparisons of classgrad against the usual alternatives (not timed tests).

Holds nothing itself: it makes ``benchmarks`` a package, so that each script runs from the
repository root as ``python -m benchmarks.NAME`` and imports its shared helpers as
``benchmarks.common`` (no ``sys.path`` edits). See RESULTS.md for the numbers and commands.
"""
