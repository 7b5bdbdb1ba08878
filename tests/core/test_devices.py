"""qjl.core.devices.on_device: a constant is copied to a device once and the copy lives as long as the constant."""

import gc

import torch

from qjl.core import devices


def test_copied_once_and_released_with_the_constant():
    t = torch.randn(8)
    assert devices.on_device(t, "cpu") is t  # already there: no copy
    a, b = devices.on_device(t, "meta"), devices.on_device(t, "meta")
    assert a is b and a.device.type == "meta" and a.shape == t.shape
    key = (id(t), "meta")
    assert key in devices._COPIES
    del t, a, b
    gc.collect()
    assert key not in devices._COPIES


def test_a_new_tensor_at_a_reused_address_gets_its_own_copy():
    t = torch.zeros(4)
    devices.on_device(t, "meta")
    u = torch.ones(4)
    devices._COPIES[(id(u), "meta")] = (lambda: None, torch.empty(0, device="meta"))  # a stale entry at u's id
    assert devices.on_device(u, "meta").shape == (4,)


def test_bad_arguments_are_named():
    import pytest

    with pytest.raises(TypeError, match="t must be"):
        devices.on_device([1.0], "cpu")
    with pytest.raises(RuntimeError):
        devices.on_device(torch.zeros(1), "no-such-device")
