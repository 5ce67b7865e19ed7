"""The Python snippets of a Markdown page, for the tests that run the docs as written.

Holds ``python_blocks``.
"""

from __future__ import annotations


def python_blocks(text: str, section: str | None = None) -> list[str]:
    """The bodies of the ```` ```python ```` blocks of ``text`` in order; with ``section`` (a
    heading line such as ``"## In a training loop"``), only those under it, up to the next
    second-level heading."""
    if section is not None:
        text = text.split(section, 1)[1].split("\n## ", 1)[0]
    return [part.split("```", 1)[0] for part in text.split("```python\n")[1:]]
