"""A random-interleaving model of gluon_grad_kernel's synchronization (kernels/chunk/gluon_grad.py), transcribed
from its sm_90 PTX (benchmarks/diagnostics/gluon_grad.py --offline --dump, bf16; the review of session 12): each
partition's warps run their own copy of the partition's shared-memory accesses, barriers and mbarrier operations in
the compiled order, including the bar.syncs the compiler added (Membar) and the dbeta reductions' scratch, under a
random scheduler, with TMA loads and each warp's share of a wgmma completing at random later steps.

Hardware semantics modelled: an mbarrier completes a phase when its pending arrivals (init count) and its
transaction bytes both reach 0 (expect adds bytes and one arrival; TMA completion subtracts its box bytes);
try_wait.parity(P) passes once the current phase's parity differs from P (a fresh barrier passes parity 1 at once);
mbarrier.arrive is one thread's after the partition's bar.sync (warp 0 here); a wgmma starts once all 4 warps of
its warp group issued it and reads its shared-memory operands until the last warp's share completes, while a
warp's wait_group waits for its own share only (so overwriting an operand needs a bar.sync after the waits);
generic reads read the whole tile (a warp's transposed or permuted load spans every warp's rows).

Checked: no hang (every wait eventually passes), every read (generic or wgmma) sees its expected version of a
tile complete, no write replaces a version some read still needs, no wgmma reads a generic store not yet fenced
(fence.proxy.async) by its writer. As compiled: clean on every run; each broken variant fails (a race or a hang)
on most runs, which shows the model can see them.

    python benchmarks/diagnostics/gluon_grad_protocol.py [RUNS]
"""
import random
import re
import sys

WG = 4  # warps of a warp group

def wy_program(v):
    P = []
    P += [("bar",), ("wait", "ready0", 0), ("wgmma", "KS", [("k", "K"), ("s", "S")]), ("wait_group", 0),
          ("read", "v", "V")]
    if v != "no barrier before X": P += [("bar",)]
    P += [("write", "v", "X"), ("write", "vn", "Xlo")]
    if v != "no fence": P += [("fence",)]
    P += [("bar",), ("read", "t", "T"),
          ("wgmma", "TX", [("v", "X")]), ("wgmma", "TX2", [("v", "X")]), ("wgmma", "TX3", [("vn", "Xlo")]),
          ("wait_group", 0)]
    if v != "no barrier before V' store": P += [("bar",)]
    P += [("write", "vn", "VN"), ("fence",), ("bar",), ("arrive", "vn_ready"), ("bar",),
          ("wait", "ready2", 0),
          ("wgmma", "dX", [("dvp", "DVP")]), ("wgmma", "dT", [("dvp", "DVP"), ("v", "X")]), ("wait_group", 1),
          ("write", "dx", "DX"), ("fence",), ("bar",), ("arrive", "dx_ready"), ("wait_group", 0), ("bar",),
          # a dbeta reduction: partial sums to the compiler's scratch; each thread combines the slots it
          # reads and writes them back itself (so no cross-warp hazard there: a tile of its own here)
          ("write", "scratch", "red1"), ("bar",), ("read", "scratch", "red1"), ("write", "scratch_b", "red1b"),
          ("bar",),
          ("read", "scratch_b", "red1b"),
          ("write", "pair0", "dTt"), ("bar",), ("write", "pair1", "dTt"), ("fence",), ("bar",),
          ("wgmma", "M1a", [("pair0", "dTt")]), ("wgmma", "M1b", [("pair1", "dTt")]),
          ("wgmma", "M1c", [("pair0", "dTt")]), ("wait_group", 0)]
    if v != "no barrier before M1 store": P += [("bar",)]
    P += [("write", "pair0", "M1"), ("bar",), ("write", "pair1", "M1"), ("fence",), ("bar",),
          ("wgmma", "KK", [("k", "K")]), ("wgmma", "Ga", [("pair0", "M1")]), ("wgmma", "Gb", [("pair1", "M1")]),
          ("wgmma", "Gc", [("pair0", "M1")]), ("wait_group", 0),
          # a dbeta reduction: partial sums to the compiler's scratch; each thread combines the slots it
          # reads and writes them back itself (so no cross-warp hazard there: a tile of its own here)
          ("write", "scratch", "red2"), ("bar",), ("read", "scratch", "red2"), ("write", "scratch_b", "red2b"),
          ("bar",),
          ("read", "scratch_b", "red2b"),
          ("write", "pair0", "R"), ("bar",), ("write", "pair1", "R"), ("fence",), ("bar",), ("arrive", "r_ready")]
    return P

def dqdk_program(v):
    P = [("wait", "ready0", 0), ("bar",), ("wait", "ready1", 0), ("wgmma", "dOS", [("do", "DO"), ("s", "S")])]
    P += [("wait", "vn_ready", 1 if v == "vn_ready parity 1" else 0)]
    P += [("wgmma", "dP", [("do", "DO"), ("vn", "VN")]), ("wait_group", 0), ("wgmma", "dPmK", [("k", "K")]),
          ("write", "dpm", "DPM"), ("fence",), ("bar",), ("wait", "ready2", 0),
          ("wgmma", "dk1", [("dpm", "DPM"), ("q", "Q")]), ("wgmma", "dk2", [("vn", "VN"), ("dh", "DH")]),
          ("wait_group", 2), ("wait", "dx_ready", 0), ("wgmma", "dk3", [("dx", "DX"), ("s", "S")]), ("bar",)]
    if v != "r_ready not waited": P += [("wait", "r_ready", 0)]
    P += [("wgmma", "dk4", [("pair0", "R"), ("k", "K")]), ("wgmma", "dk5", [("pair1", "R"), ("k", "K")]),
          ("wgmma", "dk6", [("pair0", "R"), ("k", "K")]), ("wgmma", "dk7", [("pair1", "R"), ("k", "K")]),
          ("wait_group", 0)]
    return P

def loader_program(v):
    e2 = {"short expect": 49152, "long expect": 98304}.get(v, 65536)
    return [("expect", "ready0", 81920), ("tma", "ready0", "s", "S", 32768), ("tma", "ready0", "k", "K", 16384),
            ("tma", "ready0", "v", "V", 16384), ("tma", "ready0", "t", "T", 16384),
            ("expect", "ready1", 16384), ("tma", "ready1", "do", "DO", 16384),
            ("expect", "ready2", e2), ("tma", "ready2", "dvp", "DVP", 16384), ("tma", "ready2", "q", "Q", 16384),
            ("tma", "ready2", "dh", "DH", 32768)]

class Fail(Exception):
    pass

def run(variant=None, seed=0):
    rng = random.Random(seed)
    parts = {"wy": (wy_program(variant), WG), "dqdk": (dqdk_program(variant), WG),
             "loader": (loader_program(variant), 1)}
    counts = {"ready0": 1, "ready1": 1, "ready2": 1, "vn_ready": 2 if variant == "vn_ready count 2" else 1,
              "dx_ready": 1, "r_ready": 1}
    bars = {b: dict(pending=c, tx=0, phase=0, count=c) for b, c in counts.items()}
    # reads expected of each (buffer, version): (partition, index) -> done by which warps / portions
    needed = {}
    for p, (prog, nw) in parts.items():
        for i, op in enumerate(prog):
            if op[0] == "read":
                needed.setdefault((op[1], op[2]), []).append((p, i))
            if op[0] == "wgmma":
                for b, ver in op[2]:
                    needed.setdefault((b, ver), []).append((p, i))
    done_reads = set()  # (p, i, warp) generic read done; (p, i, 'all') wgmma reads done
    bufs = {}  # name -> dict(version, parts written set, complete, unfenced set)
    pc = {(p, w): 0 for p, (prog, nw) in parts.items() for w in range(nw)}
    pending_groups = {(p, w): [] for p in parts for w in range(parts[p][1])}  # issued wgmma (p, i) per warp
    wg_issue = {}  # (p, i) -> set of warps issued
    wg_portions = {}  # (p, i) -> set of warps whose portion is still running
    tma_inflight = []
    bar_arrived = {}  # partition barrier: (p, occurrence) -> set(warps)
    bar_count = {(p, w): 0 for (p, w) in pc}

    def complete_phase(b):
        st = bars[b]
        if st["pending"] == 0 and st["tx"] == 0:
            st["phase"] ^= 1; st["pending"] = st["count"]

    def check_read(b, ver, who):
        st = bufs.get(b)
        if st is None or st["version"] != ver or not st["complete"]:
            raise Fail(f"race: {who} reads {b} expecting {ver}, holds {st and (st['version'], st['complete'])}")

    def write(b, ver, w, nw, who, is_tma=False):
        st = bufs.get(b)
        if st is not None and st["version"] != ver:
            for (p2, i2) in needed.get((b, st["version"]), []):
                op2 = parts[p2][0][i2]
                nw2 = parts[p2][1]
                if op2[0] == "read":
                    if any((p2, i2, w2) not in done_reads for w2 in range(nw2)):
                        raise Fail(f"race: {who} overwrites {b} ({st['version']} -> {ver}) before {p2}#{i2} read it")
                elif (p2, i2, "all") not in done_reads:
                    raise Fail(f"race: {who} overwrites {b} ({st['version']} -> {ver}) while wgmma {op2[1]} reads it")
        if st is None or st["version"] != ver:
            st = bufs[b] = dict(version=ver, parts=set(), complete=False, unfenced=set())
        st["parts"].add(w)
        if not is_tma:
            st["unfenced"].add(w)
        st["complete"] = is_tma or len(st["parts"]) == nw

    def step(p, w):
        prog, nw = parts[p]
        i = pc[(p, w)]
        op = prog[i]
        who = f"{p}.w{w}#{i}{op[:2]}"
        k = op[0]
        if k == "wait":
            st = bars[op[1]]
            # try_wait.parity(P) succeeds once the phase with parity P has completed: current parity != P
            if st["phase"] == op[2]:
                return False
        elif k == "bar":
            n = bar_count[(p, w)]
            s = bar_arrived.setdefault((p, n), set())
            if w not in s:
                s.add(w)
                return True  # arrived (progress); released once all have
            if len(s) < nw:
                return False
            bar_count[(p, w)] += 1
        elif k == "arrive":
            if w == 0:
                st = bars[op[1]]; st["pending"] -= 1
                if st["pending"] < 0: raise Fail(f"{who}: too many arrivals")
                complete_phase(op[1])
        elif k == "expect":
            st = bars[op[1]]; st["tx"] += op[2]; st["pending"] -= 1; complete_phase(op[1])
        elif k == "tma":
            write(op[2], op[3], 0, 1, who, is_tma=True)
            bufs[op[2]]["complete"] = False
            tma_inflight.append(op)
        elif k == "read":
            check_read(op[1], op[2], who); done_reads.add((p, i, w))
        elif k == "write":
            write(op[1], op[2], w, nw, who)
        elif k == "fence":
            for st in bufs.values(): st["unfenced"].discard(w)
        elif k == "wgmma":
            s = wg_issue.setdefault((p, i), set())
            if w not in s:
                s.add(w)
                return True
            if len(s) < nw:
                return False
            if (p, i) not in wg_portions:  # all issued: starts now
                for b, ver in op[2]:
                    check_read(b, ver, who)
                    if bufs[b]["unfenced"]:
                        raise Fail(f"{who}: wgmma reads {b} stored without a proxy fence")
                wg_portions[(p, i)] = set(range(nw))
            pending_groups[(p, w)].append((p, i))
        elif k == "wait_group":
            if len([g for g in pending_groups[(p, w)] if w in wg_portions.get(g, ())]) > op[1]:
                return False
        pc[(p, w)] += 1
        return True

    while True:
        actors = [(p, w) for (p, w) in pc if pc[(p, w)] < len(parts[p][0])]
        events = [("run", a) for a in actors]
        events += [("tma", j) for j in range(len(tma_inflight))]
        events += [("portion", g, w) for g, ws in wg_portions.items() for w in ws]
        if not actors and not tma_inflight and not any(wg_portions.values()):
            return "ok"
        rng.shuffle(events)
        progressed = False
        for ev in events:
            if ev[0] == "run":
                if step(*ev[1]):
                    progressed = True; break
            elif ev[0] == "tma":
                op = tma_inflight.pop(ev[1])
                bufs[op[2]]["complete"] = True
                st = bars[op[1]]; st["tx"] -= op[4]; complete_phase(op[1])
                progressed = True; break
            else:
                g, w = ev[1], ev[2]
                wg_portions[g].discard(w)
                if not wg_portions[g]:
                    done_reads.add((g[0], g[1], "all"))
                progressed = True; break
        if not progressed:
            stuck = {f"{p}.w{w}": parts[p][0][pc[(p, w)]][:3] for (p, w) in pc if pc[(p, w)] < len(parts[p][0])}
            raise Fail(f"hang: {stuck}")

VARIANTS = [None, "no barrier before X", "no fence", "no barrier before V' store", "no barrier before M1 store",
            "r_ready not waited",
            "short expect", "long expect", "vn_ready count 2", "vn_ready parity 1"]
if __name__ == "__main__":
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 2000
    for v in VARIANTS:
        fails = {}
        for seed in range(n):
            try:
                run(v, seed)
            except Fail as e:
                key = re.sub(r"\.w\d", "", str(e))[:90]
                fails[key] = fails.get(key, 0) + 1
        print(f"{v or 'as compiled':28} {n - sum(fails.values())}/{n} clean" + "".join(
            f"\n    {c} x {k}" for k, c in sorted(fails.items(), key=lambda kv: -kv[1])[:3]))
