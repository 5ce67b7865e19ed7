"""Shared test support: builders, harnesses and import-path targets that test files use.

Holds no tests. Test files import from here, never from each other; ``conftest.py`` files hold
fixtures only. Ray workers import some of these modules by path (``tests.support.faulty:...``,
``tests.support.slow_models:...``), so the repository root must be on their PYTHONPATH
(``harness.repo_env``).
"""
