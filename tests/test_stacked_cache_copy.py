"""The README's advice on a model's layers (one page-major cache), checked on XLA:CPU with a test FFI target
(scripts/stacked_cache_copy.py): a custom call reading `cache[l]` of a layer-stacked cache under lax.scan gets a
copy of that layer, while the stack with its leading dimensions merged (what `layer=` hands the kernel) and a
page-major cache reach it as the scan's carried buffer."""

import importlib.util
import pathlib
import shutil

import jax
import jax.numpy as jnp
import pytest

from jax_flash_mla import hlo

_spec = importlib.util.spec_from_file_location(
    "stacked_cache_copy", pathlib.Path(__file__).resolve().parents[1] / "scripts" / "stacked_cache_copy.py")
stacked_cache_copy = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(stacked_cache_copy)


@pytest.fixture(scope="module")
def target():
    if shutil.which("g++") is None:
        pytest.skip("no g++ to build the test FFI target")
    stacked_cache_copy.build_target()


def test_stacked_layer_reaches_the_custom_call_as_a_copy(target):
    name, shape = stacked_cache_copy.operand("stacked")
    assert "dynamic-slice" in name and shape == (512, 64, 1, 656)  # one layer, materialized


@pytest.mark.parametrize("layout", ["stacked-merged", "page-major"])
def test_merged_stack_and_page_major_cache_reach_the_custom_call_whole(target, layout):
    name, shape = stacked_cache_copy.operand(layout)
    assert "dynamic-slice" not in name.replace("dynamic-update-slice", "") and shape == (2048, 64, 1, 656)


def test_custom_call_operand_names_a_missing_target():
    compiled = jax.jit(lambda x: x + 1).lower(jnp.zeros(4)).compile()
    with pytest.raises(ValueError, match="no custom call to 'byte_sum'"):
        hlo.custom_call_operand(compiled, "byte_sum", 0)


# XLA:GPU's shape of a scan step: the kernel in a command buffer (a computation of its own, `call`ed), the layer's
# cache a slice of the loop's carried stack.
_COMMAND_BUFFER_HLO = """HloModule step

%command_buffer (p: s32[4,2], p.1: bf16[64,64,1,576]) -> (bf16[4,1,16,512], f32[4,16,1]) {
  %p = s32[4,2]{1,0} parameter(0)
  %p.1 = bf16[64,64,1,576]{3,2,1,0} parameter(1)
  ROOT %custom-call.1 = (bf16[4,1,16,512]{3,2,1,0}, f32[4,16,1]{2,1,0}) custom-call(%p, %p.1), custom_call_target="decode", backend_config={}
}

%body (carry: (s32[], bf16[4,64,64,1,576])) -> (s32[], bf16[4,64,64,1,576]) {
  %carry = (s32[], bf16[4,64,64,1,576]) parameter(0)
  %stack = bf16[4,64,64,1,576]{4,3,2,1,0} get-tuple-element(%carry), index=1
  %l = s32[] get-tuple-element(%carry), index=0
  %dynamic-slice_fusion = bf16[64,64,1,576]{3,2,1,0} fusion(%stack, %l), kind=kLoop, calls=%fused_slice
  %table = s32[4,2]{1,0} constant({...})
  %call = (bf16[4,1,16,512]{3,2,1,0}, f32[4,16,1]{2,1,0}) call(%table, %dynamic-slice_fusion), to_apply=%command_buffer
  ROOT %tuple = (s32[], bf16[4,64,64,1,576]) tuple(%l, %stack)
}

ENTRY %main (stack: bf16[4,64,64,1,576]) -> bf16[4,64,64,1,576] {
  ROOT %stack.1 = bf16[4,64,64,1,576]{4,3,2,1,0} parameter(0)
}
"""


def test_custom_call_operand_is_followed_out_of_the_computation_that_wraps_the_call():
    assert hlo.custom_call_operand_chain(_COMMAND_BUFFER_HLO, "decode", 1) == [
        ("%p.1", (64, 64, 1, 576)), ("%dynamic-slice_fusion", (64, 64, 1, 576))]
    assert hlo.custom_call_operand(_COMMAND_BUFFER_HLO, "decode", 0) == ("%table", (4, 2))


# `layer=` on XLA:GPU: the stack with its leading dimensions merged is a bitcast of the loop's carried buffer.
_MERGED_STACK_HLO = _COMMAND_BUFFER_HLO.replace(
    "bf16[64,64,1,576]{3,2,1,0} parameter(1)", "bf16[256,64,1,576]{3,2,1,0} parameter(1)").replace(
    "(p: s32[4,2], p.1: bf16[64,64,1,576])", "(p: s32[4,2], p.1: bf16[256,64,1,576])").replace(
    "%dynamic-slice_fusion = bf16[64,64,1,576]{3,2,1,0} fusion(%stack, %l), kind=kLoop, calls=%fused_slice",
    "%bitcast.3 = bf16[256,64,1,576]{3,2,1,0} bitcast(%stack)").replace(
    "call(%table, %dynamic-slice_fusion)", "call(%table, %bitcast.3)")


def test_custom_call_operand_is_followed_through_bitcasts_to_the_buffer_they_view():
    assert "%dynamic-slice_fusion" not in _MERGED_STACK_HLO and "call(%table, %bitcast.3)" in _MERGED_STACK_HLO
    assert hlo.custom_call_operand_chain(_MERGED_STACK_HLO, "decode", 1) == [
        ("%p.1", (256, 64, 1, 576)), ("%bitcast.3", (256, 64, 1, 576)), ("%stack", (4, 64, 64, 1, 576))]
    assert hlo.opcode(_MERGED_STACK_HLO, "%stack") == "get-tuple-element"
    assert hlo.opcode(_COMMAND_BUFFER_HLO, "%dynamic-slice_fusion") == "fusion"
    with pytest.raises(ValueError, match="no instruction '%nowhere'"):
        hlo.opcode(_COMMAND_BUFFER_HLO, "%nowhere")
