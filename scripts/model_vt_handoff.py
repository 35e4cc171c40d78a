"""A host model of the V^T hand-off when the producer WG transposes (Traits::kProducerTransposes): the producer's
TMA lane, the transposer warps and the two consumer WGs (fp8_per_tensor's page pairs, consumer_pairs.cuh, or
fp8_ds_mla's per-page split, consumer_ds.cuh) as coroutines over mbarriers, named barriers and WGMMA groups, in
random interleavings over random chunk layouts. It fails on a deadlock, on an mbarrier wait whose parity would
name the wrong phase, on a V^T or K-slot write while a WGMMA that reads it is unretired, and on a P V or S reading
another page than its own. The consumers' steps are transcribed by hand from the kernel: keep them in step.

    python3 scripts/model_vt_handoff.py [runs per consumer kind, default 3000]
"""
import random
import sys

STAGES = 3


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

    def ready(self, k):  # waiting for completion of phase index k (k < 0: the phase before init)
        hw = (self.completed & 1) != (k & 1)
        truth = self.completed >= k + 1
        if hw or truth:
            assert hw == truth and self.completed <= k + 1, f"{self.name}: phase overrun (k={k}, done={self.completed})"
        return truth


class NamedBar:
    def __init__(self, n=2):
        self.n, self.arrived, self.gen = n, 0, 0

    def arrive(self):
        g = self.gen
        self.arrived += 1
        if self.arrived == self.n:
            self.arrived, self.gen = 0, self.gen + 1
        return g


class State:
    def __init__(self, chunks, ds):
        self.ds = ds
        self.chunks = chunks  # list of page counts per chunk
        self.pages = [(ci, p) for ci, n in enumerate(chunks) for p in range(n)]
        if ds:
            self.k_full = [MBar(f"k_full{s}", 1) for s in range(STAGES - 1)]
            self.k_empty = [MBar(f"k_empty{s}", 8 + 3) for s in range(STAGES - 1)]
            self.stages = STAGES - 1
        else:
            self.k_full = [[MBar(f"k_full{s}.{q}", 1) for q in range(2)] for s in range(STAGES)]
            self.k_empty = [[MBar(f"k_empty{s}.{q}", 4 + 3) for q in range(2)] for s in range(STAGES)]
            self.stages = STAGES
        self.vt_full = [MBar(f"vt_full{b}", 3) for b in range(2)]
        self.vt_empty = [MBar(f"vt_empty{b}", 8) for b in range(2)]
        self.slot = [None] * self.stages  # ring position whose page is in the slot
        self.vt = [None] * 2
        self.groups = {0: [], 1: []}  # in-flight WGMMA groups: lists of reads
        self.named = {}

    def unretired(self, res):
        return any(res in g for wg in self.groups.values() for g in wg)


def wait(cond, what):
    return ("wait", cond, what)


def producer(st):
    for it, _ in enumerate(st.pages):
        s, k = it % st.stages, it // st.stages
        parts = [st.k_empty[s]] if st.ds else st.k_empty[s]
        for bar in parts:
            yield wait(lambda bar=bar: bar.ready(k - 1), f"producer k_empty {it}")
        assert not st.unretired(("k", s)), f"TMA into stage {s} under an unretired S read"
        st.slot[s] = it
        for bar in ([st.k_full[s]] if st.ds else st.k_full[s]):
            bar.arrive()
        yield None


def transposer(st):
    for it, _ in enumerate(st.pages):
        s, k, buf = it % st.stages, it // st.stages, it & 1
        yield wait(lambda: st.vt_empty[buf].ready((it >> 1) - 1), f"transposer vt_empty {it}")
        for bar in ([st.k_full[s]] if st.ds else st.k_full[s]):
            yield wait(lambda bar=bar: bar.ready(k), f"transposer k_full {it}")
        assert st.slot[s] == it, "transposing the wrong page"
        assert not st.unretired(("vt", buf)), f"V^T write into buffer {buf} under an unretired P V"
        st.vt[buf] = it
        yield None
        for bar in ([st.k_empty[s]] if st.ds else st.k_empty[s]):
            bar.arrive(3)
        st.vt_full[buf].arrive(3)


class WG:
    def __init__(self, st, wg):
        self.st, self.wg = st, wg

    def wgmma(self, reads):
        self.st.groups[self.wg].append(set(reads))

    def wait_group(self, n):
        g = self.st.groups[self.wg]
        del g[: max(len(g) - n, 0)]

    def issue_s(self, i):
        st = self.st
        s = i % st.stages
        for bar in ([st.k_full[s]] if st.ds else st.k_full[s]):
            yield wait(lambda bar=bar: bar.ready(i // st.stages), f"wg{self.wg} k_full {i}")
        assert st.slot[s] == i
        self.wgmma([("k", s)])

    def release(self, i):  # pairs: this WG's part of the slot
        self.st.k_empty[i % self.st.stages][self.wg].arrive(4)
        yield None

    def wait_vt(self, i):
        yield wait(lambda: self.st.vt_full[i & 1].ready(i >> 1), f"wg{self.wg} vt_full {i}")
        assert self.st.vt[i & 1] == i

    def issue_pv(self, i):
        yield from self.wait_vt(i)
        self.wgmma([("vt", i & 1)])

    def release_vt(self, i):
        self.st.vt_empty[i & 1].arrive(4)
        yield None

    def named(self, name):
        bar = self.st.named.setdefault(name, NamedBar())
        g = bar.arrive()
        yield wait(lambda: bar.gen > g, f"wg{self.wg} {name}")


def consumer_pairs(st, wg):
    w = WG(st, wg)
    it = 0
    for n in st.chunks:
        yield from w.named("kQReady")
        if n > 0:
            if wg == 0:
                yield from w.issue_s(it)
            if wg == 1 and 1 < n:
                yield from w.issue_s(it + 1)
        for page in range(0, n, 2):
            has_b, has_next, next_has_b = page + 1 < n, page + 2 < n, page + 3 < n
            ia, ib = it, it + 1
            it += 2 if has_b else 1
            if wg == 0:
                w.wait_group(0)
                if page > 0:
                    yield from w.release_vt(ia - 1)
                yield from w.release(ia)
                yield None
                yield from w.named("kPageAReady")  # publish_page A
                yield from w.issue_pv(ia)
                if has_b:
                    yield from w.named("kPageBReady")
                    yield from w.release(ib)
                    w.wait_group(0)
                    yield from w.release_vt(ia)
                    yield from w.issue_pv(ib)
                    if has_next:
                        yield from w.issue_s(ib + 1)
                    else:
                        w.wait_group(0)
                        yield from w.release_vt(ib)
                else:
                    w.wait_group(0)
                    yield from w.release_vt(ia)
            else:
                w.wait_group(0)
                if has_b:
                    yield from w.release(ib)
                if page > 0 and has_b:
                    yield from w.release_vt(ia - 1)
                yield from w.named("kPageAReady")
                yield from w.release(ia)
                yield from w.issue_pv(ia)
                yield None
                w.wait_group(0)
                yield from w.release_vt(ia)
                if has_b:
                    yield from w.named("kPageBReady")  # publish_page B
                    yield from w.issue_pv(ib)
                    if next_has_b:
                        yield from w.issue_s(ib + 2)
                    else:
                        w.wait_group(0)
                        yield from w.release_vt(ib)
        w.wait_group(0)
        assert not st.groups[wg]
        yield from w.named("kSumReady")  # epilogue


def consumer_ds(st, wg):
    w = WG(st, wg)
    it = 0
    for n in st.chunks:
        yield from w.named("kQReady")
        if n > 0:
            yield from w.issue_s(it)  # S head
        for page in range(n):
            s = it % st.stages
            w.wait_group(0)
            if page > 0:
                yield from w.release_vt(it - 1)
            w.wgmma([("k", s)])  # group 1 ...
            yield None
            w.wait_group(0)  # ... to group 3
            st.k_empty[s].arrive(4)  # release_slot: this WG's 4 warps
            yield None
            yield from w.wait_vt(it)
            if page + 1 < n:
                yield from w.issue_s(it + 1)
            yield from w.named("kMaxReady")
            yield from w.named("kPReady")
            w.wgmma([("vt", it & 1)])  # P V
            it += 1
        w.wait_group(0)
        if n > 0:
            yield from w.release_vt(it - 1)
        yield from w.named("kSumReady")


def run(chunks, ds, seed):
    rnd = random.Random(seed)
    st = State(chunks, ds)
    cons = consumer_ds if ds else consumer_pairs
    agents = {"producer": producer(st), "transposer": transposer(st), "wg0": cons(st, 0), "wg1": cons(st, 1)}
    blocked = {}
    steps = 0
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
        steps += 1
    for b in st.vt_empty:  # every V^T use handed back
        assert b.pending == 0
    return steps


if __name__ == "__main__":
    n_runs = int(sys.argv[1]) if len(sys.argv) > 1 else 3000
    rnd = random.Random(0)
    for ds in (False, True):
        for r in range(n_runs):
            chunks = [rnd.choice([0, 1, 2, 3, 4, 5, 7, 8]) for _ in range(rnd.randint(1, 4))]
            try:
                run(chunks, ds, r)
            except (AssertionError, Deadlock) as e:
                print("FAIL", "ds" if ds else "pairs", chunks, r, type(e).__name__, e)
                sys.exit(1)
        print("ok", "ds" if ds else "pairs", n_runs, "random layouts and interleavings")
