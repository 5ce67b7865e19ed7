"""Progress bars where the user looks (``classgrad.progress_bar``): in a notebook without
ipywidgets a text bar on the notebook's stderr (no terminal), with no "IProgress not found"
warning; outside a notebook the terminal rule (a bar only on a terminal, unless asked for)."""

from __future__ import annotations

import io
import sys
import types
import warnings

import pytest

from classgrad import progress_bar as bars
from classgrad.workers import zoo
from classgrad.workers.gradients import per_class_gradients


class NotebookStderr(io.StringIO):
    """What a Jupyter kernel's ``sys.stderr`` (ipykernel's OutStream) is to tqdm: no terminal."""

    def isatty(self) -> bool:
        return False


class ZMQInteractiveShell:  # the class name ipykernel's shell has
    pass


def stderr_of(monkeypatch) -> NotebookStderr:
    """``sys.stderr`` replaced for the rest of the test (in its body: pytest puts its own capture
    back between a fixture's setup and the test)."""
    err = NotebookStderr()
    monkeypatch.setattr(sys, "stderr", err)
    return err


@pytest.fixture
def notebook(monkeypatch):
    """This process as a Jupyter kernel without ipywidgets."""
    ipython = types.ModuleType("IPython")
    ipython.get_ipython = ZMQInteractiveShell  # type: ignore[attr-defined] # returns a shell
    monkeypatch.setitem(sys.modules, "IPython", ipython)
    monkeypatch.setitem(sys.modules, "ipykernel.zmqshell", types.ModuleType("ipykernel.zmqshell"))
    monkeypatch.setitem(sys.modules, "ipywidgets", None)  # import ipywidgets raises ImportError


def test_a_notebook_without_ipywidgets_gets_a_text_bar_and_no_warning(notebook, monkeypatch):
    import classgrad.workers.gradients.python_api as python_api

    monkeypatch.setattr(python_api, "PROGRESS_DELAY_S", 0.0)  # the default bar, without waiting 2 s for it
    err = stderr_of(monkeypatch)
    assert bars.in_notebook()
    model = zoo.mlp(6, in_features=8).eval()
    data = zoo.synthetic_probe(6, 3, kind="vector", input_shape=(8,), seed=4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # tqdm.auto's TqdmWarning "IProgress not found" would fail here
        per_class_gradients(model, data, num_classes=6)  # progress=None: shown, since a notebook shows it
    text = err.getvalue()
    assert "per_class_gradients" in text and "6/6" in text and "rows" in text, text
    err.seek(0)
    err.truncate()
    per_class_gradients(model, data, num_classes=6, progress=False)
    assert err.getvalue() == ""


def test_outside_a_notebook_a_bar_shows_on_a_terminal_or_when_asked_for(monkeypatch):
    err = stderr_of(monkeypatch)
    assert not bars.in_notebook()
    with bars.progress_bar(3, desc="x", unit="rows") as bar:  # stderr is no terminal: off
        bar.update(3)
    assert err.getvalue() == ""
    with bars.progress_bar(3, desc="x", unit="rows", show=True) as bar:
        bar.update(3)
    assert "3/3" in err.getvalue()


def test_a_jobs_progress_is_a_bar_in_a_notebook(notebook, monkeypatch):
    from classgrad.service.driver_runtime.progress import Progress

    err = stderr_of(monkeypatch)
    progress = Progress(4, label="run r")
    progress.update(4)
    progress.close()
    assert progress.mode == "bar" and "4/4" in err.getvalue()
