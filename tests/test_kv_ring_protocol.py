"""The K-slot ring of the few-rows decode kernel (consumer_narrow.cuh) as a discrete-event model.

One producer fills a ring of S shared-memory slots in page order (TMA: the fill lands after a random latency); two
consumer warpgroups take alternate pages of each chunk. Each slot has an "empty" mbarrier (the consumer releases the
slot) and "full" mbarriers (the fill landed). mbarrier waits test only a phase's parity (PTX ISA, mbarrier.try_wait
.parity: true once the phase with that parity completed, i.e. when the current phase's parity differs), so a waiter
that falls two phases behind a barrier's history reads a stale answer.

The kernel gives each consumer WG its own set of full barriers (`SplitKvMlaKernel::full_barriers`); each WG keeps
one phase bit per stage of its set. The model checks that a consumer never passes its wait before its own page
landed in the slot, under random latencies, for the kernel's stage counts (fp8_per_tensor 4, fp8_ds_mla 3) and for
chunks of odd and even length, and that the same check catches the shared-set protocol that session 8's fp8_ds_mla
kernel used (a WG computing the parity of page i as (i / S) & 1 on a barrier both WGs wait on).
"""

from __future__ import annotations

import heapq
import random

import pytest

NUM_WGS = 2


class MBarrier:
    """Phase bookkeeping of an mbarrier whose phases complete one after another."""

    def __init__(self):
        self.completed = 0  # phases completed so far; the current phase is number `completed`

    def try_wait_parity(self, parity: int) -> bool:
        return (self.completed & 1) != parity


def simulate(chunk_lengths, stages: int, per_wg_sets: bool, seed: int) -> int:
    """Runs the ring over the chunks; returns 1 at the first consumer wait that passes before its page landed
    (what follows in the kernel is undefined: a slot read while it is written, then released early), else 0."""
    rng = random.Random(seed)
    owners = []  # per ring position i: the WG that takes the page (alternate pages of each chunk)
    for n in chunk_lengths:
        owners += [k % NUM_WGS for k in range(n)]
    pages = len(owners)
    empty = [MBarrier() for _ in range(stages)]
    full = [[MBarrier() for _ in range(stages)] for _ in range(NUM_WGS if per_wg_sets else 1)]
    landed = [None] * stages  # ring position whose bytes the slot holds (once its fill landed)
    events = []  # (time, order, kind, payload)
    order = 0

    def push(t, kind, payload):
        nonlocal order
        heapq.heappush(events, (t, order, kind, payload))
        order += 1

    # Producer: fill position i once the slot's previous fill was released (parity (i / S) & 1 ^ 1).
    next_fill = 0
    # Consumers: the next ring position each WG takes, its per-stage phase bits, and whether it is busy.
    next_page = [owners.index(w) if w in owners else pages for w in range(NUM_WGS)]
    phase_bits = [0] * NUM_WGS
    busy = [False] * NUM_WGS
    early = False  # a wait passed before its page landed
    time = 0.0

    def owner_set(w):
        return full[w] if per_wg_sets else full[0]

    def step():
        """Lets every agent act that can; returns whether any did."""
        nonlocal next_fill, early
        acted = False
        if next_fill < pages:
            i = next_fill
            s = i % stages
            if empty[s].try_wait_parity(((i // stages) & 1) ^ 1):
                # arrive.expect_tx now; the phase completes when the bytes land.
                push(time + rng.expovariate(1.0) * 8.0, "land", i)
                next_fill += 1
                acted = True
        for w in range(NUM_WGS):
            i = next_page[w]
            if busy[w] or i >= pages:
                continue
            s = i % stages
            if per_wg_sets:
                parity = (phase_bits[w] >> s) & 1
            else:
                parity = (i // stages) & 1
            if owner_set(w)[s].try_wait_parity(parity):
                if per_wg_sets:
                    phase_bits[w] ^= 1 << s
                if landed[s] != i:
                    early = True
                    return False
                busy[w] = True
                push(time + rng.uniform(1.0, 6.0), "release", (w, i))
                acted = True
        return acted

    while True:
        while step():
            pass
        if early:
            return 1
        if not events:
            break
        time, _, kind, payload = heapq.heappop(events)
        if kind == "land":
            i = payload
            landed[i % stages] = i
            owner_set(owners[i])[i % stages].completed += 1
        else:
            w, i = payload
            empty[i % stages].completed += 1  # the WG's 4 warps arrive: one phase
            busy[w] = False
            nxt = i + 1
            while nxt < pages and owners[nxt] != w:
                nxt += 1
            next_page[w] = nxt
    assert next_fill == pages and all(p >= pages for p in next_page), "the ring deadlocked"
    return 0


CHUNKS = {
    "one long chunk": [31],
    "even chunks": [8, 12, 6],
    "odd chunks": [3, 5, 1, 7, 2, 9],
}


@pytest.mark.parametrize("stages", [3, 4], ids=["fp8_ds_mla 3 stages", "fp8_per_tensor 4 stages"])
@pytest.mark.parametrize("chunks", list(CHUNKS.values()), ids=list(CHUNKS))
def test_per_wg_full_barriers_never_pass_early(stages, chunks):
    assert sum(simulate(chunks, stages, per_wg_sets=True, seed=seed) for seed in range(200)) == 0


@pytest.mark.parametrize(
    "stages, chunks",
    [(3, CHUNKS["one long chunk"]), (4, CHUNKS["odd chunks"])],
    ids=["3 stages: every second use of a slot", "4 stages: after a chunk of odd length"],
)
def test_shared_full_barriers_can_pass_early(stages, chunks):
    # The model sees the failure the per-WG sets remove (so the test above can fail).
    assert sum(simulate(chunks, stages, per_wg_sets=False, seed=seed) for seed in range(200)) > 0


def test_shared_full_barriers_are_safe_when_every_slot_has_one_owner():
    # 4 stages and chunks of even length: consecutive fills of a slot always go to the same WG, no stale wait.
    assert sum(simulate(CHUNKS["even chunks"], 4, per_wg_sets=False, seed=seed) for seed in range(200)) == 0
