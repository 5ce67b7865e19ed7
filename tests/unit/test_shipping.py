"""The user's own module beside the job file (``classgrad.workers.imports`` fallback and
``classgrad.service.driver_runtime.shipping``): imported from the working directory when nothing else
finds it, remembered, shipped as Ray's ``working_dir``, with the actors' local paths absolute.
The real job through Ray is tests/integration/test_hf_job.py."""

from __future__ import annotations

import sys

import pytest

from classgrad.errors import InputError
from classgrad.service.driver_runtime import shipping
from classgrad.service.driver_runtime.submit import DEFAULT_EXCLUDES
from classgrad.workers import imports


@pytest.fixture
def user_dir(tmp_path, monkeypatch):
    (tmp_path / "own_factories_x1.py").write_text("def build(n):\n    return n * 2\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    monkeypatch.setattr(imports, "_FROM_WORKING_DIR", set())
    yield tmp_path
    sys.modules.pop("own_factories_x1", None)


def test_a_module_found_only_in_the_working_directory_is_imported_and_remembered(user_dir):
    assert shipping.working_dir_env() is None  # nothing imported from there yet
    assert imports.import_object("own_factories_x1:build")(3) == 6
    assert imports.from_working_dir() == {"own_factories_x1"}
    env = shipping.working_dir_env()
    assert env == {"working_dir": str(user_dir), "excludes": list(DEFAULT_EXCLUDES)}


def test_a_module_that_is_nowhere_is_still_one_line(user_dir):
    with pytest.raises(InputError, match="cannot import module 'not_here_x1'"):
        imports.import_object("not_here_x1:build", what="model.factory")
    assert imports.from_working_dir() == frozenset()
    assert imports.import_object("classgrad.workers.zoo:mlp") is not None  # importable as it is: not shipped
    assert imports.from_working_dir() == frozenset()


def test_actors_in_a_copied_directory_get_absolute_local_paths(user_dir):
    config = {"store": {"url": "out/g.zarr"}, "model": {"checkpoint": "w.pt"}, "loss": {}}
    got = shipping.actor_config(config, shipped=True)
    assert got["store"]["url"] == str(user_dir / "out" / "g.zarr")
    assert got["model"]["checkpoint"] == str(user_dir / "w.pt")
    assert config["store"]["url"] == "out/g.zarr"  # the driver's own config is untouched
    s3 = {"store": {"url": "s3://b/g.zarr"}, "model": {"checkpoint": None}}
    assert shipping.actor_config(s3, shipped=True) == s3
    assert shipping.actor_config(config, shipped=False) is config
