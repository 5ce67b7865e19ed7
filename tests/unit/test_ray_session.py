"""Where the driver and ``classgrad similarity`` get their Ray from: the address they join (the
option, else ``RAY_ADDRESS`` as ``ray.init`` reads it) and the one-line refusal of an address
nothing listens at. Nothing here starts Ray."""

from __future__ import annotations

import re
import socket

import pytest

from classgrad.errors import ClassgradError
from classgrad.service.driver_runtime.ray_session import check_reachable, ray_session, resolve_ray_address
from classgrad.service.driver_runtime.run_ids import new_run_id


def _closed_port() -> int:
    """A loopback port nothing listens at (bound for a moment, then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_no_address_and_no_environment_means_a_local_ray(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert resolve_ray_address(None, "cluster.address") == (None, "")
    assert resolve_ray_address("  ", "cluster.address") == (None, "")


def test_ray_address_is_honoured_when_no_address_or_auto_is_given(monkeypatch):
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.5:6379")
    assert resolve_ray_address(None, "--address") == ("10.0.0.5:6379", "RAY_ADDRESS")
    assert resolve_ray_address("auto", "--address") == ("10.0.0.5:6379", "RAY_ADDRESS")  # as ray.init does
    # An address the user gave explicitly wins over the environment.
    assert resolve_ray_address("10.0.0.9:6379", "--address") == ("10.0.0.9:6379", "--address")
    monkeypatch.delenv("RAY_ADDRESS")
    assert resolve_ray_address("auto", "cluster.address") == ("auto", "cluster.address")


def test_an_unreachable_host_port_is_refused_in_one_line():
    address = f"127.0.0.1:{_closed_port()}"
    with pytest.raises(ClassgradError) as info:
        check_reachable(address, "cluster.address", timeout_s=5.0)
    message = str(info.value)
    assert message.startswith(f"cannot reach the Ray cluster at {address} (cluster.address): "), message
    assert "\n" not in message


def test_addresses_without_a_host_port_are_left_to_ray():
    for address in ("auto", "local", "ray://127.0.0.1:1", "head-node"):
        check_reachable(address, "cluster.address", timeout_s=0.1)  # no socket is opened: no error


def test_the_session_refuses_an_unreachable_ray_address_before_starting_ray(monkeypatch):
    ray = pytest.importorskip("ray")
    assert not ray.is_initialized()
    address = f"127.0.0.1:{_closed_port()}"
    monkeypatch.setenv("RAY_ADDRESS", address)
    with pytest.raises(ClassgradError, match=re.escape(f"cannot reach the Ray cluster at {address} (RAY_ADDRESS)")):
        with ray_session(None, option="--address"):
            pass
    assert not ray.is_initialized()


def test_run_ids_sort_by_start_time_and_differ():
    first, second = new_run_id(), new_run_id("similarity")
    assert re.fullmatch(r"\d{8}T\d{6}Z-[0-9a-f]{6}", first), first
    assert re.fullmatch(r"similarity-\d{8}T\d{6}Z-[0-9a-f]{6}", second), second
    assert new_run_id() != new_run_id()
