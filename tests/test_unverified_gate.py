"""The opt-in gate for kernels not yet verified on a GPU (jax_flash_mla._ffi.UNVERIFIED_FORMATS), CPU-only.

A format in UNVERIFIED_FORMATS whose kernel is built must stay out of kernel_formats() (so it runs the jnp
reference) unless JAX_FLASH_MLA_UNVERIFIED_KERNELS=1. The extension's format list is monkeypatched, so this runs
without the extension and without a GPU.
"""

from __future__ import annotations

import pytest

import jax_flash_mla as fm
from jax_flash_mla import _ffi

BUILT = frozenset({"bf16", "fp8_per_tensor", "fp8_ds_mla"})


@pytest.fixture
def all_built(monkeypatch):
    monkeypatch.setattr(_ffi, "_FORMATS", BUILT)
    monkeypatch.delenv(_ffi.UNVERIFIED_ENV, raising=False)


def test_fp8_ds_mla_is_unverified():
    assert _ffi.UNVERIFIED_FORMATS == frozenset({"fp8_ds_mla"})
    assert _ffi.UNVERIFIED_ENV == "JAX_FLASH_MLA_UNVERIFIED_KERNELS"


def test_unverified_formats_left_out_by_default(all_built):
    assert _ffi.kernel_formats() == BUILT - _ffi.UNVERIFIED_FORMATS
    assert not _ffi.unverified_kernels_enabled()


@pytest.mark.parametrize("value, enabled", [("1", True), ("0", False), ("", False)])
def test_environment_variable_opts_in(all_built, monkeypatch, value, enabled):
    monkeypatch.setenv(_ffi.UNVERIFIED_ENV, value)
    assert _ffi.unverified_kernels_enabled() == enabled
    assert _ffi.kernel_formats() == (BUILT if enabled else BUILT - _ffi.UNVERIFIED_FORMATS)


def test_public_kernel_formats_follows_the_gate(all_built, monkeypatch):
    monkeypatch.setattr(fm, "hopper_devices_only", lambda: True)
    assert "fp8_ds_mla" not in fm.kernel_formats()
    monkeypatch.setenv(_ffi.UNVERIFIED_ENV, "1")
    assert fm.kernel_formats() == BUILT


def test_unbuilt_format_is_not_added_by_the_opt_in(monkeypatch):
    monkeypatch.setattr(_ffi, "_FORMATS", frozenset({"bf16"}))
    monkeypatch.setenv(_ffi.UNVERIFIED_ENV, "1")
    assert _ffi.kernel_formats() == frozenset({"bf16"})
