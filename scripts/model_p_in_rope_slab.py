"""A host model of bf16's page pairs with P_A in page A's K slot RoPE slab and P_B in a tile of its own
(Traits::kPInRopeSlab, kBRightFirst; consumer_pairs.cuh): the producer's TMA lane and the two consumer WGs as
coroutines over mbarriers (k_full / k_empty per slot part), named barriers and WGMMA groups, in random interleavings
over random chunk layouts. It fails on a deadlock, on an mbarrier wait whose parity would name the wrong phase, on a
TMA write into a slot part that an unretired WGMMA still reads, on a P store into a slab that the page's S has not
finished reading or that holds another page, on a P_B store under an unretired read of the P tile, and on a WGMMA
reading another page's P. The consumers' steps are transcribed by hand from the kernel: keep them in step.

    python3 scripts/model_p_in_rope_slab.py [runs, default 3000]
"""
import random
import sys

STAGES = 2


class Deadlock(Exception):
    pass


class MBar:
    def __init__(self, name, count):
        self.name, self.count, self.pending, self.completed = name, count, 0, 0

    def arrive(self, w=1):
        self.pending += w
        assert self.pending <= self.count, f"{self.name}: over-arrival"
        if self.pending == self.count:
            self.completed += 1
            self.pending = 0

    def ready(self, k):  # completion of phase index k (k < 0: the phase before init)
        hw = (self.completed & 1) != (k & 1)
        truth = self.completed >= k + 1
        if hw or truth:
            assert hw == truth and self.completed <= k + 1, f"{self.name}: phase overrun (k={k}, done={self.completed})"
        return truth


class State:
    def __init__(self, chunks):
        self.chunks = chunks
        self.k_full = [[MBar(f"k_full{s}.{q}", 1) for q in range(2)] for s in range(STAGES)]
        self.k_empty = [[MBar(f"k_empty{s}.{q}", 4 if q == 0 else 8) for q in range(2)] for s in range(STAGES)]
        self.slot = [[None, None] for _ in range(STAGES)]  # page held by each part of each slot
        self.p_owner = [None] * STAGES  # page whose P_A the RoPE slab holds
        self.p_tile_owner = None  # page whose P_B the P tile holds
        self.groups = {0: [], 1: []}
        self.named = {}

    def unretired(self, res):
        return any(res in g for wg in self.groups.values() for g in wg)


def wait(cond, what):
    return ("wait", cond, what)


def producer(st):
    pages = [offset for n in st.chunks for offset in range(n)]  # each page's offset in its chunk
    for it, offset in enumerate(pages):
        s, k = it % STAGES, it // STAGES
        for part in ((1, 0) if offset % 2 else (0, 1)):  # left part first; a page B's right part first
            yield wait(lambda part=part: st.k_empty[s][part].ready(k - 1), f"producer k_empty {it}.{part}")
            assert not st.unretired(("k", s, part)), f"TMA into slot {s} part {part} under an unretired read"
            if part == 1:
                assert not st.unretired(("p", s)), f"TMA over slot {s}'s P under an unretired P V"
                st.p_owner[s] = None
            st.slot[s][part] = it
            st.k_full[s][part].arrive()
            yield None


class WG:
    def __init__(self, st, wg):
        self.st, self.wg = st, wg

    def wgmma(self, reads):
        self.st.groups[self.wg].append(set(reads))

    def wait_group(self, n):
        g = self.st.groups[self.wg]
        del g[: max(len(g) - n, 0)]

    def issue_s(self, i, right_first=False):
        s = i % STAGES
        for part in ((1, 0) if right_first else (0, 1)):
            yield wait(lambda part=part: self.st.k_full[s][part].ready(i // STAGES), f"wg{self.wg} k_full {i}")
            assert self.st.slot[s][part] == i
        self.wgmma([("k", s, 0), ("k", s, 1)])

    def release_part(self, i, part):
        self.st.k_empty[i % STAGES][part].arrive(4)
        yield None

    def store_p(self, i, role):
        s = i % STAGES
        if role == 0:  # P_A: page A's RoPE slab
            assert self.st.slot[s][1] == i, "P into a slab that holds another page"
            assert not self.st.unretired(("k", s, 1)), "P over the RoPE slab while its S reads it"
            self.st.p_owner[s] = i
        else:  # P_B: the P tile
            assert not self.st.unretired(("ptile",)), "P_B over the P tile while a P V reads it"
            self.st.p_tile_owner = i
        yield None

    def issue_pv(self, i, own_p, role):
        s = i % STAGES
        assert self.st.slot[s][self.wg] == i
        reads = [("k", s, self.wg)]  # this WG's V half: slab part wg
        if not own_p:
            if role == 0:
                assert self.st.p_owner[s] == i, "P V reads another page's P"
                reads.append(("p", s))
            else:
                assert self.st.p_tile_owner == i, "P V reads another page's P"
                reads.append(("ptile",))
        self.wgmma(reads)

    def named(self, name):
        bar = self.st.named.setdefault(name, [0, 0])  # arrived, generation
        g = bar[1]
        bar[0] += 1
        if bar[0] == 2:
            bar[0], bar[1] = 0, bar[1] + 1
        yield wait(lambda: bar[1] > g, f"wg{self.wg} {name}")


def consumer(st, wg):
    w = WG(st, wg)
    it = 0
    for n in st.chunks:
        yield from w.named("kQReady")
        for page in range(0, n, 2):
            has_b = page + 1 < n
            ia, ib = it, it + 1
            it += 2 if has_b else 1
            if wg == 0:
                yield from w.issue_s(ia)
                w.wait_group(0)
                yield from w.release_part(ia, 1)  # S_A was WG0's last read of A's right part
                yield from w.store_p(ia, 0)
                yield from w.named("kPageAReady")
                w.issue_pv(ia, own_p=True, role=0)
                if has_b:
                    yield from w.named("kPageBReady")
                    yield from w.release_part(ib, 1)  # WG0 never reads page B's right part
                    w.wait_group(0)
                    yield from w.release_part(ia, 0)
                    w.issue_pv(ib, own_p=False, role=1)
                    yield None
                    w.wait_group(0)
                    yield from w.release_part(ib, 0)
                else:
                    w.wait_group(0)
                    yield from w.release_part(ia, 0)
            else:
                if has_b:
                    yield from w.issue_s(ib, right_first=True)
                w.wait_group(0)
                yield from w.named("kPageAReady")
                w.issue_pv(ia, own_p=False, role=0)
                yield None
                if has_b:
                    yield from w.store_p(ib, 1)
                    yield from w.named("kPageBReady")
                w.wait_group(0)
                yield from w.release_part(ia, 1)
                if has_b:
                    w.issue_pv(ib, own_p=True, role=1)
                    yield None
                    w.wait_group(0)
                    yield from w.release_part(ib, 1)
        w.wait_group(0)
        yield from w.named("kSumReady")


def run(chunks, seed):
    rnd = random.Random(seed)
    st = State(chunks)
    agents = {"producer": producer(st), "wg0": consumer(st, 0), "wg1": consumer(st, 1)}
    blocked = {}
    while agents:
        runnable = [a for a in agents if a not in blocked or blocked[a][0]()]
        if not runnable:
            raise Deadlock({a: blocked[a][1] for a in blocked})
        a = rnd.choice(runnable)
        blocked.pop(a, None)
        try:
            y = next(agents[a])
        except StopIteration:
            del agents[a]
            continue
        if y is not None and y[0] == "wait" and not y[1]():
            blocked[a] = (y[1], y[2])


if __name__ == "__main__":
    n_runs = int(sys.argv[1]) if len(sys.argv) > 1 else 3000
    rnd = random.Random(0)
    for r in range(n_runs):
        chunks = [rnd.choice([0, 1, 2, 3, 4, 5, 7, 8]) for _ in range(rnd.randint(1, 4))]
        try:
            run(chunks, r)
        except (AssertionError, Deadlock) as e:
            print("FAIL", chunks, r, type(e).__name__, e)
            sys.exit(1)
    print("ok", n_runs, "random layouts and interleavings")
