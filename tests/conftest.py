"""Test-session setup that must happen before JAX initializes its backends, and fixtures shared by test files."""

import os

import pytest

# tests/test_sharding.py and tests/test_decode_step.py need 8 host (CPU) devices for their meshes. The flag only adds
# CPU devices: it changes nothing for single-device tests or for the GPU backend.
_DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"
if _DEVICE_COUNT_FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_DEVICE_COUNT_FLAG}=8".strip()


@pytest.fixture
def compilations():
    """The XLA compilations made while the test runs (JAX's compile-duration events)."""
    seen = []

    def listener(event, duration, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            seen.append(duration)

    import jax  # (after the XLA flags above)

    jax.monitoring.register_event_duration_secs_listener(listener)
    yield seen
    jax.monitoring.unregister_event_duration_listener(listener)
