"""scripts/gpu_serving_check.py's readers of XLA output, on text shaped like what jax 0.11.2 printed on the H200
(docs/PERF.md): the command-buffer evidence must find custom calls inside kCommandBuffer thunks and only there."""

import importlib.util
import pathlib

_spec = importlib.util.spec_from_file_location(
    "gpu_serving_check", pathlib.Path(__file__).resolve().parents[1] / "scripts" / "gpu_serving_check.py")
check = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(check)

# Abridged from module_4001.jit_decode_step.thunk_sequence_after_thunk_passes.txt (H200, 2026-12-02).
CAPTURED = """\
000: kCommandBuffer [source       | next=005 (1)]
    001: kCustomKernel [source | sink] loop_add_select_fusion grid: [1, 1, 1] threads: [32, 1, 1]
005: kWhile         [prev=000 (1) | next=000 (1)]
condition:
    006: kCustomKernel [source | sink] loop_compare_fusion grid: [1, 1, 1] threads: [1, 1, 1]
  body:
    007: kAsyncStart    [source        | next=000 (11)] stream=computation_stream[1], async_id=7
        009: kDynamicSliceFusion [source | sink] params=1, results=1
    000: kCommandBuffer [source        | next=000 (11)]
        035: kCustomKernel [source | sink] loop_cosine_sine_fusion grid: [8, 1, 1] threads: [128, 1, 1]
        036: kCustomCall   [source | sink] kCustomCall
    000: kCommandBuffer [prev=000 (2)  | next=000 (2) ]
        051: kCustomKernel [prev=050 (1) | next=052 (1)] input_concatenate_fusion grid: [2048, 1, 1]
        052: kCustomCall   [prev=051 (1) | sink        ] kCustomCall
000: kCommandBuffer [prev=005 (1) | sink        ]
    059: kCustomKernel [source       | next=060 (1)] triton_softmax_4 grid: [32, 1, 1] threads: [64, 1, 1]
"""


def test_custom_calls_inside_command_buffers_are_counted():
    assert check.thunk_custom_calls(CAPTURED) == (4, 2, 2)


def test_a_custom_call_outside_every_command_buffer_is_seen():
    outside = CAPTURED.replace(
        "    000: kCommandBuffer [prev=000 (2)  | next=000 (2) ]\n", "    041: kGemm [source | sink]\n")
    assert check.thunk_custom_calls(outside) == (3, 1, 2)


_NESTED_HLO = """HloModule step

%inner (p: bf16[4]) -> bf16[4] {
  %p = bf16[4]{0} parameter(0)
  ROOT %custom-call.1 = bf16[4]{0} custom-call(%p), custom_call_target="decode"
}

%command_buffer (p.1: bf16[4]) -> bf16[4] {
  %p.1 = bf16[4]{0} parameter(0)
  ROOT %call = bf16[4]{0} call(%p.1), to_apply=%inner
}

ENTRY %main (x: bf16[4]) -> bf16[4] {
  %x = bf16[4]{0} parameter(0)
  ROOT %call.1 = bf16[4]{0} call(%x), to_apply=%command_buffer
}
"""


def test_in_command_buffer_follows_calls_out_of_the_command_buffer():
    assert check.in_command_buffer(_NESTED_HLO, 'custom_call_target="decode"') == (1, True)
    assert check.in_command_buffer(_NESTED_HLO.replace("%command_buffer", "%other"), "decode") == (0, False)
