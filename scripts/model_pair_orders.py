"""The bf16 page-pair protocol of the 64-row decode kernel (consumer_pairs.cuh) as a discrete-event model.

Two consumer warpgroups take the pages of each chunk in pairs (A, B); a producer refills the two K slots part by part
(left: V channels 0-255; right: V channels 256-511 and the RoPE slab, where WG0 stores P_A). The model runs the
kernel's sequence of waits, WGMMA issues, retirements, barriers and hand-offs for each WG under random durations
(softmax work, WGMMA time on one in-order tensor pipe, TMA latency) and checks what the GPU cannot show cheaply:
- no deadlock (both WGs and the producer finish);
- a WG passes a full barrier only when its own page has landed in that slot part;
- no refill starts while a WGMMA still reads the slot part, and no generic write (P_A, zeroed stale V rows) goes to
  a part that was handed back;
- every hand-off reads the pair's own value: the row maxima (ref_max, the max_ready mbarriers' parities), P_A in
  page A's RoPE slab, P_B in its tile (not rewritten while the other WG's WGMMA reads it).
mbarrier waits test only a phase's parity (PTX ISA, mbarrier.try_wait.parity), as in tests/test_kv_ring_protocol.py.

Orders: "main" (consumer_pairs.cuh's pair) and "fmo" (experiment fmo's kernel, FlashMLA's hand-off order; `e75ccc0`,
reverted; docs/PERF.md session 40): WG0 hands page A's row max to WG1 at once through an mbarrier, stores P_A at the
pair's reference m_B and queues the next S_A behind P_B V_B,L; WG1 sends m_B before its exponentials and multiplies
P_A V_A,R before P_B V_B,R; the producer keeps main's part order. Mutations that break the protocol must be caught
(MUTATIONS), so the checks can fail; tests/test_model_pair_orders.py runs a short version of both.

A first version (`e75ccc0`) also estimated the pair's period from durations fitted to the event trace of main. It
attributed most of the pair to the refills' latency, and knockout `nrfl` (session 40: no refills at all) showed
that at C2 the pair does not wait for them, so that part is gone (docs/PERF.md session 40).

    python3 scripts/model_pair_orders.py [random layouts per order, default 3000]
"""

from __future__ import annotations

import heapq
import random
import sys

STAGES = 2


class ProtocolError(AssertionError):
    pass


class Sim:
    """One run of the protocol over `chunks` (pages per chunk) in `order`, optionally with a `mutation`, with random
    durations. run() returns the end time and raises ProtocolError at the first broken rule."""

    def __init__(self, chunks, order: str, seed: int, mutation: str | None = None):
        self.rng = random.Random(seed)
        self.order = order
        self.mutation = mutation
        self.now = 0.0
        self.events = []  # (time, seq, callback)
        self.seq = 0
        # Slot parts: the ring position whose bytes they hold (None while a refill is in flight).
        self.holds = [[None, None] for _ in range(STAGES)]
        self.full = [[0, 0] for _ in range(STAGES)]  # completed phases of each part's full barrier
        self.empty = [[0, 0] for _ in range(STAGES)]  # completed phases of k_empty
        self.empty_arrivals = [[0, 0] for _ in range(STAGES)]
        self.empty_count = [1, 2]  # WG-level arrivals: left part WG0; right part both WGs
        self.mbar = {"max0": 0, "max1": 0}
        self.ref = {0: None, 1: None}
        self.p_tile = None  # pair index whose P_B the tile holds
        self.p_a = [None] * STAGES  # ring position whose P_A the slot's RoPE slab holds
        self.bars = {name: {"gen": 0, "arrived": set()} for name in ("A", "B", "stale0", "stale1")}
        self.pipe_free = 0.0
        self.groups = {0: [], 1: []}  # per WG: (completion time, reads) of committed WGMMA batches
        # The pairs of every chunk: (pair index, ring position of A, of B or None, B-pair index, partial last page).
        self.pairs = []
        self.next_in_chunk = []
        pos = pair = b_pairs = 0
        for n in chunks:
            partial = self.rng.random() < 0.5
            for page in range(0, n, 2):
                has_b = page + 1 < n
                last = page + (2 if has_b else 1) >= n
                self.pairs.append((pair, pos, pos + 1 if has_b else None, b_pairs, partial and last))
                self.next_in_chunk.append(page + 2 < n)
                pair += 1
                b_pairs += has_b
                pos += 2 if has_b else 1
        self.actors = {"wg0": self.wg0(), "wg1": self.wg1(), "producer": self.producer()}
        self.pending = {name: None for name in self.actors}
        self.asleep = set()
        self.op_state = {}

    # ------------------------------------------------------------ helpers
    def fail(self, what):
        raise ProtocolError(f"t={self.now:.2f}: {what}")

    def at(self, t, fn):
        heapq.heappush(self.events, (t, self.seq, fn))
        self.seq += 1

    def in_flight_reads(self):
        for wg, groups in self.groups.items():
            for done, reads in groups:
                if done > self.now:
                    yield wg, reads

    def slot(self, pos, part):
        return ("slot", pos % STAGES, part)

    # --------------------------------------------------------- the actors
    def producer(self):
        # Left part first; a page B's right part first (kBRightFirst).
        for _, ia, ib, _, _ in self.pairs:
            for pos, part in [(ia, 0), (ia, 1)] + ([(ib, 1), (ib, 0)] if ib is not None else []):
                yield ("wait_empty", pos, part)
                yield ("tma", pos, part)

    def wg0(self):
        fmo = self.order == "fmo"
        s_issued = False
        for k, ia, ib, kb, partial in self.pairs:
            has_b = ib is not None
            zero_a = partial and not has_b
            if self.mutation == "release_b_right_at_top" and has_b:
                yield ("arrive_empty", ib, 1)  # WG0's arrival on page B's right part before WG1's S_B read it
            if not s_issued:
                yield ("wait_full", ia, 0)
                yield ("wait_full", ia, 1)
                yield ("mma", [self.slot(ia, 0), self.slot(ia, 1)])
            s_issued = False
            yield ("wait_mma", 0)
            yield ("arrive_empty", ia, 1)  # S_A was WG0's last read of A's right part
            yield ("work",)  # mask, row max, exponentials
            yield ("write_ref", 0, k)
            if fmo:
                yield ("mbar_arrive", "max0")
                if zero_a:
                    yield ("write_slot", ia, 0)
                    yield ("write_slot", ia, 1)
                    yield ("bar", "stale0", 1)
                yield ("mma", [self.slot(ia, 0)])  # P_A V_A,L, P_A from registers
                if has_b:
                    parity = (k if self.mutation == "max1_parity_per_pair" else kb) & 1
                    yield ("mbar_wait", "max1", parity)
                    yield ("read_ref", 1, k)
                yield ("work",)  # P_A rescaled to m_B, stored
                yield ("write_p_a", ia, 1)
                if self.mutation == "release_a_left_early":
                    yield ("arrive_empty", ia, 0)
                    yield ("wait_mma", 0)
                else:
                    yield ("wait_mma", 0)
                    yield ("arrive_empty", ia, 0)
                yield ("bar", "A", 2)
                if has_b:
                    yield ("bar", "B", 2)
                    yield ("arrive_empty", ib, 1)
                    yield ("mma", [("p_tile", k), self.slot(ib, 0)])  # P_B V_B,L
                    if self.next_in_chunk[k]:  # the next S_A, left part then right part, behind P_B V_B,L
                        na = ib + 1
                        yield ("wait_full", na, 0)
                        yield ("mma", [self.slot(na, 0)])
                        yield ("wait_mma", 1)
                        yield ("arrive_empty", ib, 0)
                        yield ("wait_full", na, 1)
                        yield ("mma", [self.slot(na, 1)])
                        s_issued = True
                    else:
                        yield ("wait_mma", 0)
                        yield ("arrive_empty", ib, 0)
            else:
                if zero_a:
                    yield ("write_slot", ia, 0)
                    yield ("write_slot", ia, 1)
                yield ("work",)  # P stored
                yield ("write_p_a", ia, 1)
                yield ("bar", "A", 2)
                yield ("mma", [self.slot(ia, 0)])  # P_A V_A,L
                if has_b:
                    yield ("bar", "B", 2)
                    if self.mutation != "release_b_right_at_top":
                        yield ("arrive_empty", ib, 1)
                    yield ("wait_mma", 0)
                    yield ("arrive_empty", ia, 0)
                    yield ("read_ref", 1, k)
                    yield ("mma", [("p_tile", k), self.slot(ib, 0)])  # P_B V_B,L
                    if self.mutation != "release_b_left_unretired":
                        yield ("wait_mma", 0)
                    yield ("arrive_empty", ib, 0)
                else:
                    yield ("wait_mma", 0)
                    yield ("arrive_empty", ia, 0)

    def wg1(self):
        fmo = self.order == "fmo"
        for k, ia, ib, kb, partial in self.pairs:
            has_b = ib is not None
            zero_b = partial and has_b
            if has_b:
                yield ("wait_full", ib, 1)  # kBRightFirst
                yield ("wait_full", ib, 0)
                yield ("mma", [self.slot(ib, 0), self.slot(ib, 1)])
                yield ("wait_mma", 0)
                yield ("work",)  # mask, row max
            if fmo:
                yield ("mbar_wait", "max0", k & 1)
                yield ("read_ref", 0, k)
                if has_b:
                    yield ("write_ref", 1, k)
                    yield ("mbar_arrive", "max1")
                    yield ("work",)  # exponentials of B
                    if zero_b:
                        yield ("write_slot", ib, 0)
                        yield ("write_slot", ib, 1)
                        yield ("bar", "stale1", 1)
                    yield ("work",)  # P_B stored
                    yield ("write_p_tile", k)
                yield ("bar", "A", 2)
                yield ("mma", [("p_a", ia), self.slot(ia, 1)])  # P_A V_A,R
                if has_b:
                    yield ("mma", [self.slot(ib, 1)])  # P_B V_B,R from registers
                    yield ("bar", "B", 2)
                    if self.mutation != "release_a_right_unretired":
                        yield ("wait_mma", 1)
                    yield ("arrive_empty", ia, 1)
                    yield ("wait_mma", 0)
                    yield ("arrive_empty", ib, 1)
                else:
                    yield ("wait_mma", 0)
                    yield ("arrive_empty", ia, 1)
            else:
                if not has_b:
                    yield ("wait_mma", 0)
                yield ("bar", "A", 2)
                yield ("read_ref", 0, k)
                yield ("mma", [("p_a", ia), self.slot(ia, 1)])  # P_A V_A,R
                if has_b:
                    yield ("work",)  # softmax of B
                    yield ("write_ref", 1, k)
                    if zero_b:
                        yield ("write_slot", ib, 0)
                        yield ("write_slot", ib, 1)
                    yield ("work",)  # P stored
                    yield ("write_p_tile", k)
                    yield ("bar", "B", 2)
                yield ("wait_mma", 0)
                yield ("arrive_empty", ia, 1)
                if has_b:
                    yield ("mma", [self.slot(ib, 1)])  # P_B V_B,R
                    yield ("wait_mma", 0)
                    yield ("arrive_empty", ib, 1)

    # ------------------------------------------------------ the operations
    def try_op(self, name, op):
        """Performs `op` of actor `name` if it can proceed now; returns whether it did."""
        kind = op[0]
        wg = 0 if name == "wg0" else 1
        if kind == "wait_empty":
            _, pos, part = op
            stage = pos % STAGES
            return (self.empty[stage][part] & 1) != (((pos // STAGES) & 1) ^ 1)
        if kind == "tma":
            _, pos, part = op
            stage = pos % STAGES
            for other, reads in self.in_flight_reads():
                if ("slot", stage, part) in reads:
                    self.fail(f"refill of slot {stage} part {part} (page {pos}) while WG{other}'s WGMMA reads it")
            self.holds[stage][part] = None

            def land():
                self.holds[stage][part] = pos
                self.full[stage][part] += 1

            self.at(self.now + self.rng.uniform(0.5, 1.5), land)
            return True
        if kind == "wait_full":
            _, pos, part = op
            stage = pos % STAGES
            if (self.full[stage][part] & 1) == ((pos // STAGES) & 1):
                return False
            if self.holds[stage][part] != pos:
                self.fail(f"WG{wg} passed slot {stage} part {part}'s full barrier for page {pos}, "
                          f"which holds {self.holds[stage][part]}")
            return True
        if kind == "mma":
            reads = op[1]
            for r in reads:
                if r[0] == "slot" and self.holds[r[1]][r[2]] is None:
                    self.fail(f"WG{wg} reads slot {r[1]} part {r[2]} while it is refilled")
                if r[0] == "p_tile" and self.p_tile != r[1]:
                    self.fail(f"WG{wg} reads P_B of pair {r[1]}, the tile holds {self.p_tile}")
                if r[0] == "p_a" and self.p_a[r[1] % STAGES] != r[1]:
                    self.fail(f"WG{wg} reads P_A of page {r[1]}, the slab holds {self.p_a[r[1] % STAGES]}")
            reads = [("slot", r[1] % STAGES, 1) if r[0] == "p_a" else r for r in reads] + [
                ("p_tile",) for r in reads if r[0] == "p_tile"]
            done = max(self.now, self.pipe_free) + self.rng.uniform(0.1, 0.7)
            self.pipe_free = done
            self.groups[wg].append((done, reads))
            self.at(done, lambda: None)
            return True
        if kind == "wait_mma":
            outstanding = sum(done > self.now for done, _ in self.groups[wg])
            return outstanding <= op[1]
        if kind == "arrive_empty":
            _, pos, part = op
            stage = pos % STAGES
            self.empty_arrivals[stage][part] += 1
            if self.empty_arrivals[stage][part] == self.empty_count[part]:
                self.empty_arrivals[stage][part] = 0
                self.empty[stage][part] += 1
            return True
        if kind == "write_ref":
            self.ref[op[1]] = op[2]
            return True
        if kind == "read_ref":
            if self.ref[op[1]] != op[2]:
                self.fail(f"WG{wg} read ref_max[{op[1]}] of pair {self.ref[op[1]]} in pair {op[2]}")
            return True
        if kind == "mbar_arrive":
            self.mbar[op[1]] += 1
            return True
        if kind == "mbar_wait":
            return (self.mbar[op[1]] & 1) != op[2]
        if kind in ("write_slot", "write_p_a"):
            pos = op[1]
            part = 1 if kind == "write_p_a" else op[2]
            stage = pos % STAGES
            if self.holds[stage][part] != pos:
                self.fail(f"WG{wg} writes slot {stage} part {part} of page {pos}, which holds "
                          f"{self.holds[stage][part]}")
            for other, reads in self.in_flight_reads():
                if ("slot", stage, part) in reads:
                    self.fail(f"WG{wg} writes slot {stage} part {part} while WG{other}'s WGMMA reads it")
            if kind == "write_p_a":
                self.p_a[stage] = pos
            return True
        if kind == "write_p_tile":
            for other, reads in self.in_flight_reads():
                if ("p_tile",) in reads:
                    self.fail(f"WG{wg} rewrites the P_B tile while WG{other}'s WGMMA reads it")
            self.p_tile = op[1]
            return True
        if kind == "bar":
            _, bar_name, parties = op
            bar = self.bars[bar_name]
            key = name  # an actor waits on one barrier at a time
            if key not in self.op_state:
                self.op_state[key] = bar["gen"]
                bar["arrived"].add(name)
                if len(bar["arrived"]) == parties:
                    bar["gen"] += 1
                    bar["arrived"].clear()
            if bar["gen"] > self.op_state[key]:
                del self.op_state[key]
                return True
            return False
        if kind == "work":
            self.asleep.add(name)
            self.at(self.now + self.rng.uniform(0.2, 1.0), lambda: self.asleep.discard(name))
            return True
        raise ValueError(kind)

    def run(self):
        for name, gen in self.actors.items():
            self.pending[name] = next(gen, None)
        while True:
            progressed = True
            while progressed:
                progressed = False
                for name, gen in self.actors.items():
                    while self.pending[name] is not None and name not in self.asleep and \
                            self.try_op(name, self.pending[name]):
                        self.pending[name] = next(gen, None)
                        progressed = True
            if all(op is None for op in self.pending.values()):
                return self.now
            if not self.events:
                stuck = {n: op for n, op in self.pending.items() if op is not None}
                self.fail(f"deadlock: {stuck}")
            t, _, fn = heapq.heappop(self.events)
            self.now = max(self.now, t)
            fn()


# Chunk lengths in pages: odd and even counts, lone pages, empty chunks, pairs whose page A falls in slot 1.
CHUNK_SETS = [[6], [1], [3], [2, 1, 4], [5, 0, 3, 2], [1, 1, 1, 2], [7, 4, 1, 6, 3]]
# Broken protocols the checks must catch: a part handed back before the last WGMMA reading it retired (main: WG0 on
# page B's right part at the pair's top, B's left part with P_B V_B,L in flight; fmo: A's left part with P_A V_A,L
# in flight, A's right part with P_A V_A,R in flight), and fmo's max_ready[1] parity counted per pair where it
# completes per pair with a page B.
MUTATIONS = [("main", "release_b_right_at_top"), ("main", "release_b_left_unretired"),
             ("fmo", "max1_parity_per_pair"), ("fmo", "release_a_left_early"), ("fmo", "release_a_right_unretired")]


def mutation_caught(order, mutation, seeds=60):
    """In how many of `seeds` runs the checks stop a broken protocol."""
    caught = 0
    for seed in range(seeds):
        try:
            Sim([3, 2, 5, 1, 4], order, seed, mutation).run()
        except ProtocolError:
            caught += 1
    return caught


def main():
    runs = int(sys.argv[1]) if len(sys.argv) > 1 else 3000
    rnd = random.Random(0)
    for order in ("main", "fmo"):
        for r in range(runs):
            Sim([rnd.choice([0, 1, 2, 3, 4, 5, 7, 8]) for _ in range(rnd.randint(1, 4))], order, r).run()
        print(f"protocol ok: {order}, {runs} random chunk layouts and timings")
    for order, mutation in MUTATIONS:
        caught = mutation_caught(order, mutation)
        print(f"mutation {order} {mutation}: caught in {caught} of 60 runs")
        if caught == 0:
            sys.exit(f"the model misses {mutation}")


if __name__ == "__main__":
    main()
