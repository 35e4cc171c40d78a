"""Test-session setup that must happen before JAX initializes its backends."""

import os

# tests/test_sharding.py and tests/test_decode_step.py need 8 host (CPU) devices for their meshes. The flag only adds
# CPU devices: it changes nothing for single-device tests or for the GPU backend.
_DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"
if _DEVICE_COUNT_FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_DEVICE_COUNT_FLAG}=8".strip()
