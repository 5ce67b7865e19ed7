"""Progress bars that show where the user looks: a terminal, or a notebook with or without ipywidgets.

Holds ``in_notebook`` (this process is a Jupyter kernel: its stderr is no terminal, but the
notebook shows a text bar's carriage returns as one line that updates) and ``progress_bar`` (a
tqdm bar: the notebook widget where ipywidgets is installed, else tqdm's text bar, which in a
notebook is shown although stderr is no terminal). ``tqdm.auto`` instead warns "IProgress not
found" in a notebook without ipywidgets and falls back to a text bar that its default
(``disable=None``: off unless stderr is a terminal) then hides.
"""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["in_notebook", "progress_bar"]


def in_notebook() -> bool:
    """Whether a Jupyter kernel (notebook, JupyterLab, VS Code, Colab) runs this process."""
    if "ipykernel.zmqshell" not in sys.modules:
        return False
    get_ipython = getattr(sys.modules.get("IPython"), "get_ipython", None)
    shell = get_ipython() if callable(get_ipython) else None
    return type(shell).__name__ == "ZMQInteractiveShell"


def _has_widgets() -> bool:
    try:
        import ipywidgets  # noqa: F401
    except ImportError:
        return False
    return True


def progress_bar(total: int, *, desc: str, unit: str, show: bool | None = None, delay: float = 0.0) -> Any:
    """A tqdm bar of ``total`` steps. ``show``: True always, None only where someone sees it (a
    terminal, or a notebook), False never (a disabled bar: ``update`` costs nothing)."""
    notebook = in_notebook()
    if notebook and show is not False and _has_widgets():
        from tqdm.notebook import tqdm as notebook_bar

        return notebook_bar(total=total, unit=unit, desc=desc, delay=delay)
    from tqdm.std import tqdm as text_bar

    # disable=None is tqdm's own "off unless stderr is a terminal"; a notebook's stderr is not one.
    disable = True if show is False else (False if show or notebook else None)
    return text_bar(total=total, unit=unit, desc=desc, disable=disable, delay=delay, dynamic_ncols=True)
