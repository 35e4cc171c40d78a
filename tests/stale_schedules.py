"""Split-KV schedules computed for other lengths than the step's, for the tests of metadata reuse under jit.

Under jit nothing checks passed metadata: make_chunk (cpp/kernels/sm90/decode/splitkv_mla.cuh) must read every key
once whatever lengths it was computed for. Each schedule here names the hazards it is there for, and
`hazards_held` finds them in the metadata, so that the tests assert them before the kernel runs (test_decode_gpu.py)
and in CI (test_sched_meta.py): a scheduler change cannot leave a case testing nothing.

The step's lengths end with a page holding 4 keys, and the GPU test scales that page's latent by 2 (`last_page_gain`),
so that keys missed at the end fail the FP8 tolerances (cos 2e-3, rel-L2 6e-2). Measured on the reference (CPU,
fp8_per_tensor / fp8_ds_mla): leaving out the last 3 keys of the sequences whose last split "earlier" holds alone in
a partition (0, 4, 5: what session 31's consumers skipped) moves the output by cos 8.6e-3 / rel-L2 0.13 at s_q 2,
h_q 64 and cos 1.7e-2 / 1.9e-2, rel-L2 0.18 / 0.19 at s_q 1, h_q 16; without the gain by cos 8.5e-5 / 1.6e-4 and
rel-L2 1.3e-2 / 1.8e-2 only, inside the tolerances.
"""

from __future__ import annotations

import dataclasses

import numpy as np

import jax.numpy as jnp

import jax_flash_mla as fm
from jax_flash_mla.scheduler import PAGE_SIZE, ROWS_PER_TILE

# The step's cache_seqlens: long sequences split over many partitions, short and empty ones; every nonempty one ends
# with 4 keys in its last page.
LENGTHS = np.array([4100, 132, 0, 68, 2052, 1028], np.int32)

HAZARDS = {
    "last_split_alone_ends_early": "a partition holding only a sequence's last split (index > 0), its given end "
                                   "before the length (session 31: the consumers took it for split 0 and ended it "
                                   "there, the producer at the length)",
    "whole_ends_early": "a sequence of one split, its given end before the length",
    "empty_split_then_more": "a split (index > 0) starting past the page the sequence ends in (it reads no page), "
                             "followed in its partition by another sequence's chunk",
    "empty_last_split": "a sequence's last split (index > 0) starting past the page the sequence ends in",
    "split_ends_past_length": "a split before the sequence's last, its given end past the length",
}


@dataclasses.dataclass(frozen=True)
class StaleSchedule:
    name: str
    meta_lengths: np.ndarray  # what get_mla_metadata was given
    parts: int  # partitions per (KV head, row tile)
    hazards: tuple[str, ...]

    def metadata(self, rows: int, h_kv: int = 1, implementation: str = "auto") -> fm.MlaMetadata:
        """get_mla_metadata's for `rows` query rows per KV head, with the SM count that gives `parts` partitions
        (the same schedule for both kernels, whatever the card)."""
        num_sms = self.parts * h_kv * -(-rows // ROWS_PER_TILE)
        return fm.get_mla_metadata(jnp.asarray(self.meta_lengths), rows, h_kv, num_sms=num_sms,
                                   implementation=implementation)


SCHEDULES = [
    # A step earlier (3 keys fewer each): the last splits end 3 keys short unless make_chunk ends them at the length.
    StaleSchedule("earlier", np.maximum(LENGTHS - 3, 0), 66, ("last_split_alone_ends_early", "whole_ends_early")),
    # Longer sequences split over 8 partitions: splits start past where the sequences now end.
    StaleSchedule("split_longer", LENGTHS + 3000, 8,
                  ("empty_split_then_more", "empty_last_split", "split_ends_past_length")),
    # The batch's lengths reversed: some sequences whole but too short, others split past their ends.
    StaleSchedule("permuted", LENGTHS[::-1].copy(), 8,
                  ("whole_ends_early", "empty_last_split", "split_ends_past_length")),
]


def last_page_gain(j: int, n: int) -> float:
    """oracle.make_decode_inputs' page_gain: each sequence's last page at twice the latent."""
    return 2.0 if j == n - 1 else 1.0


def hazards_held(sched_meta, num_splits, lengths) -> set[str]:
    """The HAZARDS that this metadata (as get_mla_metadata gives it) holds for the step's `lengths`."""
    splits = np.diff(np.asarray(num_splits))
    lengths = np.asarray(lengths)
    held = set()
    for bb, bt, eb, et, bs in np.asarray(sched_meta)[:, :5].tolist():
        if bb > eb:  # empty partition
            continue
        first_is_last_split = bs == splits[bb] - 1
        if bs > 0 and bt >= -(-int(lengths[bb]) // PAGE_SIZE) * PAGE_SIZE:
            if eb > bb:
                held.add("empty_split_then_more")
            if first_is_last_split:
                held.add("empty_last_split")
        if bb == eb and bs > 0 and first_is_last_split and et < lengths[bb]:
            held.add("last_split_alone_ends_early")
        end_split = bs if eb == bb else 0  # the index of the partition's last chunk
        if splits[eb] == 1 and et < lengths[eb]:
            held.add("whole_ends_early")
        if end_split < splits[eb] - 1 and et > lengths[eb]:
            held.add("split_ends_past_length")
    return held
