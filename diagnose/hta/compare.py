"""Our numbers next to HTA's, check by check: `hta_extras(diagnosis, result) -> dict`.

The output is the plain-JSON `Diagnosis.extras["hta"]`. Where a number of ours and one of
HTA's measure the same thing they are compared against a stated tolerance; where they
differ by more, the entry says so and spells out both definitions. Neither tool's number
is preferred: a disagreement is a reason to look at the trace, not a verdict.
"""
from __future__ import annotations

import math
import numbers
import statistics
from collections import defaultdict

from diagnose.hta.runner import COULD_NOT, HtaResult
from diagnose.model import Check, Diagnosis

SHARE_TOL = 0.10
"""Shares of time (0..1): 10 percentage points. The two tools use different windows (our
complete ProfilerSteps vs HTA's first-to-last-kernel span), which alone moves a share by a
few points; more than ten means the definitions, not the window, differ."""
HOST_TOL = 0.20
"""Share of idle time attributed to the host: HTA's is per stream and ours device-wide, so wider."""
DELAY_TOL_US, DELAY_TOL_REL = 5.0, 0.5
"""Median launch delay: within 5 us or 50%, whichever is larger (medians of few-us values)."""

LIMITATIONS = (
    "HTA measures each rank between its first and last GPU kernel and drops the last profiled step; "
    "ours measures complete ProfilerSteps. Per-step HTA figures here are its totals divided by the steps it kept.",
    "HTA's straggler check (get_potential_stragglers) only recognises communication kernels named "
    "ncclKernel*, not ncclDevKernel* (NCCL >= 2.19, RCCL), and defaults to rank 0: it is not used; "
    "our straggler check matches collectives across ranks instead.",
    "HTA classifies kernels by name: NCCL/HCCL and any name starting with 'hip' count as communication, "
    "Memcpy/Memset as memory, everything else as computation.",
    "HTA fails on CPU-only traces (no GPU streams) and loads slowly on large traces (time grows with "
    "events x steps), so it runs in a separate process under a size budget and a time limit.",
)

DEF_IDLE = ("Idle share. Ours: per step, the time no kernel, memcpy, memset or collective runs on any stream, "
            "over the step (complete ProfilerSteps). HTA (temporal breakdown): the time no kernel of any kind runs, "
            "over the span from the rank's first to its last kernel.")
DEF_HOST = ("Idle time blamed on the host. Ours: device-wide idle time (all streams idle, outside DataLoader "
            "waits) during which the host is busy in CPU ops other than synchronisation calls, over all "
            "device idle time outside DataLoader waits. HTA (idle time breakdown, on the stream with the most "
            "computation-kernel time): a gap is 'host wait' when the next kernel's launch call started after "
            "the previous kernel on that stream ended, 'kernel wait' when the gap is below HTA's consecutive-"
            "kernel threshold, 'other' otherwise (e.g. the stream waits on an event from another stream, such "
            "as a compute stream waiting for NCCL). HTA looks at one stream at a time, so a stream counts as "
            "idle while another stream runs.")
DEF_DELAY = ("Launch delay. Both: a kernel's start minus the end of the runtime call that launched it, matched by "
             "correlation id. HTA also includes memcpy/memset launches; ours kernels only.")
DEF_EXPOSED = ("Communication not hidden, share of the step. Ours: exposed communication plus waiting for the "
               "last-arriving rank (our finding reports only the first; the wait is the straggler check's and is "
               "added back here), over the step; our 'compute' includes memcpy and memset. HTA (temporal "
               "breakdown, 'non-compute'): the time only non-computation kernels run (communication AND "
               "memcpy/memset, which HTA does not count as compute), over the first-to-last-kernel span.")
DEF_OVERLAP = ("Overlap. Ours: the share of per-step communication time that runs while compute (kernels, memcpy, "
               "memset) runs. HTA: the share of communication-kernel time that runs while a computation kernel "
               "runs (memcpy/memset not counted as computation), over the whole span.")
DEF_COMPUTE = ("Compute share. Ours: compute (kernels, memcpy, memset) per step, over the step. HTA: computation "
               "kernels only, over the first-to-last-kernel span.")


def _median(values) -> float | None:
    vals = [v for v in values if isinstance(v, (int, float))]
    return float(statistics.median(vals)) if vals else None


def _r(x: float | None, nd: int = 4) -> float | None:
    return None if x is None else round(float(x), nd)


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.0%}" if abs(x) >= 0.1 else f"{x:.1%}"


def compare(quantity: str, ours: float | None, hta: float | None, tolerance: float, tolerance_text: str,
            definition: str, *, unit: str = "share") -> dict:
    """One like-for-like comparison. `agrees` is None when either side has no number."""
    out = {"quantity": quantity, "ours": _r(ours), "hta": _r(hta), "unit": unit, "tolerance": tolerance_text,
           "definition": definition}
    if ours is None or hta is None:
        missing = "ours" if ours is None else "HTA's"
        out.update(agrees=None, note=f"not compared: {missing} number is not available for this trace")
        return out
    out["agrees"] = bool(abs(ours - hta) <= tolerance)
    out["difference"] = _r(ours - hta)
    return out


def _delay_compare(ours: float | None, hta: float | None) -> dict:
    tol = max(DELAY_TOL_US, DELAY_TOL_REL * max(abs(ours or 0.0), abs(hta or 0.0)))
    return compare("median kernel launch delay", ours, hta, tol, f"{DELAY_TOL_US:g} us or "
                   f"{DELAY_TOL_REL:.0%}, whichever is larger", DEF_DELAY, unit="us")


def _our_breakdown(d: Diagnosis) -> dict[int, dict[str, float]]:
    acc: dict[int, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for s in d.breakdown:
        for k in ("step_ms", "compute_ms", "exposed_comm_ms", "straggler_wait_ms", "dataloader_ms", "other_ms"):
            acc[s.rank][k].append(getattr(s, k))
    return {r: {k: sum(v) / len(v) for k, v in comps.items()} for r, comps in acc.items()}


def _share(num: float, den: float) -> float | None:
    return num / den if den > 0 else None


def _entry(comparisons: list[dict], hta_says: str, numbers: dict, ours: dict, check: Check | None) -> dict:
    decided = [c for c in comparisons if c["agrees"] is not None]
    agrees = all(c["agrees"] for c in decided) if decided else None
    entry = {"hta_says": hta_says, "numbers": numbers, "ours": ours, "comparisons": comparisons,
             "agrees": agrees, "check_status": check.status if check else None,
             "tolerance": "; ".join(f"{c['quantity']}: {c['tolerance']}" for c in comparisons),
             "definitions": " ".join(c["definition"] for c in comparisons)}
    off = [c for c in decided if not c["agrees"]]
    if off:
        parts = [f"{c['quantity']}: ours {_fmt(c['ours'], c['unit'])}, HTA {_fmt(c['hta'], c['unit'])}" for c in off]
        entry["disagreement"] = ("Our number and HTA's differ by more than the tolerance on " + "; ".join(parts)
                                 + ". They are defined differently: " + " ".join(c["definition"] for c in off)
                                 + " Neither is preferred; look at the trace to see which definition matters here.")
    return entry


def _fmt(v: float | None, unit: str) -> str:
    if v is None:
        return "n/a"
    return f"{v:,.1f} us" if unit == "us" else _pct(v)


def _failed_entry(reason: str, check: Check | None) -> dict:
    return {"hta_says": reason, "numbers": {}, "ours": {}, "comparisons": [], "agrees": None,
            "check_status": check.status if check else None, "tolerance": "", "definitions": ""}


def _main_stream(streams: dict) -> tuple[str, dict] | None:
    if not streams:
        return None
    sid = max(streams, key=lambda s: (streams[s].get("compute_kernel_us", 0.0), streams[s].get("kernel_us", 0.0)))
    return sid, streams[sid]


def _launch_entry(res: HtaResult, ours_bd: dict, check: Check | None) -> dict:
    temporal, idle, launch = res.get("temporal"), res.get("idle"), res.get("launch")
    if not (temporal.ok or idle.ok or launch.ok):
        return _failed_entry(temporal.error or COULD_NOT + "no analysis finished", check)
    f = check.finding if check else None
    m = f.metrics if f else {}
    steps = max(len(res.steps), 1)
    numbers: dict = {"per_rank": {}}
    hta_idle, hta_host, hta_delay = {}, {}, {}
    if temporal.ok:
        for r, t in temporal.data.items():
            share = _share(t.get("idle_us") or 0.0, t.get("kernel_span_us") or 0.0)
            hta_idle[r] = share
            numbers["per_rank"].setdefault(r, {}).update(idle_share=_r(share),
                                                         idle_ms_per_step=_r((t.get("idle_us") or 0) / 1000 / steps, 3))
    if idle.ok:
        for r, streams in idle.data.items():
            main = _main_stream(streams)
            if main is None:
                continue
            sid, s = main
            total = sum(s.get(k, 0.0) for k in ("host_wait_us", "kernel_wait_us", "other_us"))
            hta_host[r] = _share(s.get("host_wait_us", 0.0), total)
            numbers["per_rank"].setdefault(r, {}).update(
                main_stream=int(sid), host_wait_share_of_idle=_r(hta_host[r]),
                kernel_wait_share_of_idle=_r(_share(s.get("kernel_wait_us", 0.0), total)),
                other_share_of_idle=_r(_share(s.get("other_us", 0.0), total)),
                host_wait_ms_per_step=_r(s.get("host_wait_us", 0.0) / 1000 / steps, 3))
    if launch.ok:
        for r, s in launch.data.items():
            hta_delay[r] = s.get("median_launch_delay_us")
            numbers["per_rank"].setdefault(r, {}).update(median_launch_delay_us=_r(hta_delay[r], 2))
    numbers.update(idle_share=_r(_median(hta_idle.values())), host_wait_share_of_idle=_r(_median(hta_host.values())),
                   median_launch_delay_us=_r(_median(hta_delay.values()), 2), steps_kept=list(res.steps))
    our_idle = _median(_share(b["dataloader_ms"] + b["other_ms"], b["step_ms"]) for b in ours_bd.values())
    our_host = m.get("host_busy_share_of_idle") if isinstance(m.get("host_busy_share_of_idle"), (int, float)) else None
    our_delay = m.get("median_launch_delay_us") if isinstance(m.get("median_launch_delay_us"), (int, float)) else None
    ours = {"device_idle_share": _r(our_idle), "host_busy_share_of_idle": our_host,
            "median_launch_delay_us": our_delay, "recoverable_ms": f.recoverable_ms if f else None}
    comps = [compare("GPU idle share", our_idle, numbers["idle_share"], SHARE_TOL, "10 percentage points", DEF_IDLE),
             compare("share of idle time blamed on the host", our_host, numbers["host_wait_share_of_idle"], HOST_TOL,
                     "20 percentage points", DEF_HOST),
             _delay_compare(our_delay, numbers["median_launch_delay_us"])]
    says = []
    if temporal.ok:
        says.append(f"the GPU is idle {_pct(numbers['idle_share'])} of the time between its first and last kernel "
                    "(temporal breakdown, median rank)")
    else:
        says.append(f"temporal breakdown: {temporal.error}")
    if idle.ok and hta_host:
        kw = _median(p.get("kernel_wait_share_of_idle") for p in numbers["per_rank"].values())
        ot = _median(p.get("other_share_of_idle") for p in numbers["per_rank"].values())
        says.append(f"on the busiest compute stream, idle time is {_pct(numbers['host_wait_share_of_idle'])} host "
                    f"wait, {_pct(kw)} kernel wait and {_pct(ot)} other (idle time breakdown, median rank)")
    elif not idle.ok:
        says.append(f"idle time breakdown: {idle.error}")
    if launch.ok and numbers["median_launch_delay_us"] is not None:
        says.append(f"median launch delay {numbers['median_launch_delay_us']:,.1f} us")
    return _entry(comps, "; ".join(says) + ".", numbers, ours, check)


def _comm_entry(res: HtaResult, ours_bd: dict, check: Check | None) -> dict:
    temporal, overlap = res.get("temporal"), res.get("overlap")
    if not (temporal.ok or overlap.ok):
        return _failed_entry(temporal.error or overlap.error or COULD_NOT + "no analysis finished", check)
    f = check.finding if check else None
    m = f.metrics if f else {}
    numbers: dict = {"per_rank": {}}
    non_compute, ov = {}, {}
    if temporal.ok:
        for r, t in temporal.data.items():
            non_compute[r] = _share(t.get("non_compute_us") or 0.0, t.get("kernel_span_us") or 0.0)
            numbers["per_rank"].setdefault(r, {})["non_compute_share"] = _r(non_compute[r])
    if overlap.ok:
        for r, v in overlap.data.items():
            ov[r] = v
            numbers["per_rank"].setdefault(r, {})["comm_overlapped_share"] = _r(v)
    numbers.update(non_compute_share=_r(_median(non_compute.values())), comm_overlapped_share=_r(_median(ov.values())))
    our_exposed = _median(_share(b["exposed_comm_ms"] + b["straggler_wait_ms"], b["step_ms"]) for b in ours_bd.values())
    our_exposed_only = _median(_share(b["exposed_comm_ms"], b["step_ms"]) for b in ours_bd.values())
    our_overlap = m.get("overlapped_share") if isinstance(m.get("overlapped_share"), (int, float)) else None
    ours = {"exposed_plus_wait_share": _r(our_exposed), "exposed_share": _r(our_exposed_only),
            "overlapped_share": our_overlap, "recoverable_ms": f.recoverable_ms if f else None}
    comps = [compare("communication not hidden under compute, share of the step", our_exposed,
                     numbers["non_compute_share"], SHARE_TOL, "10 percentage points", DEF_EXPOSED),
             compare("share of communication overlapped by compute", our_overlap, numbers["comm_overlapped_share"],
                     SHARE_TOL, "10 percentage points", DEF_OVERLAP)]
    says = []
    if overlap.ok and numbers["comm_overlapped_share"] is None:
        says.append("HTA finds no communication kernels to overlap (overlap undefined)")
    elif overlap.ok:
        says.append(f"{_pct(numbers['comm_overlapped_share'])} of communication-kernel time overlaps computation "
                    "kernels (median rank)")
    else:
        says.append(f"comm/compute overlap: {overlap.error}")
    if temporal.ok:
        says.append(f"only non-computation kernels (communication, memcpy, memset) run "
                    f"{_pct(numbers['non_compute_share'])} of the kernel span")
    return _entry(comps, "; ".join(says) + ".", numbers, ours, check)


def _run_entry(res: HtaResult, ours_bd: dict) -> dict:
    temporal = res.get("temporal")
    base = {"steps_kept": list(res.steps), "ranks": list(res.ranks)}
    if not temporal.ok:
        return {**base, "hta_says": temporal.error, "per_rank": {}, "comparisons": []}
    steps = max(len(res.steps), 1)
    per_rank = {}
    for r, t in temporal.data.items():
        span = t.get("kernel_span_us") or 0.0
        per_rank[r] = {"kernel_span_ms": _r(span / 1000, 3), "kernel_span_ms_per_step": _r(span / 1000 / steps, 3),
                       "idle_share": _r(_share(t.get("idle_us") or 0.0, span)),
                       "compute_share": _r(_share(t.get("compute_us") or 0.0, span)),
                       "non_compute_share": _r(_share(t.get("non_compute_us") or 0.0, span))}
    med = {k: _median(p[k] for p in per_rank.values()) for k in ("idle_share", "compute_share", "non_compute_share")}
    our_compute = _median(_share(b["compute_ms"], b["step_ms"]) for b in ours_bd.values())
    comps = [compare("compute share", our_compute, med["compute_share"], SHARE_TOL, "10 percentage points",
                     DEF_COMPUTE)]
    says = (f"temporal breakdown (median rank, over {len(res.steps) or 'its'} step(s) kept): compute "
            f"{_pct(med['compute_share'])}, non-compute {_pct(med['non_compute_share'])}, "
            f"idle {_pct(med['idle_share'])}"
            " of the kernel span.")
    return {**base, "hta_says": says, "per_rank": per_rank, **{k: _r(v) for k, v in med.items()},
            "comparisons": comps, "agrees": all(c["agrees"] for c in comps if c["agrees"] is not None)}


def _critical_path_entry(res: HtaResult) -> dict:
    cp = res.analyses.get("critical_path")
    if cp is None:
        return {"status": "not_run", "hta_says": "critical path analysis was not requested"}
    if not cp.ok:
        return {"status": "failed", "hta_says": cp.error}
    data = cp.data
    bound = {k: v for k, v in sorted(data.get("bound_by", {}).items(), key=lambda kv: -kv[1]) if v >= 0.0005}
    parts = ", ".join(f"{_pct(v)} {k.replace('_', ' ')}" for k, v in bound.items())
    out = {"status": "ok", "rank": data.get("rank"), "step_instance": data.get("step_instance"),
           "path_ms": _r((data.get("path_us") or 0) / 1000, 3), "bound_by": bound,
           "hta_says": f"critical path of rank {data.get('rank')}'s profiled step #{data.get('step_instance')} "
                       f"(counting from 0): {parts}."}
    if not data.get("has_cuda_sync_events"):
        out["caveat"] = ("The trace has no CUDA synchronisation events (profiler option added in PyTorch 2.1), so HTA "
                         "cannot see where the CPU waited for the GPU: the CPU-bound share may be overstated.")
    return out


def _plain(x):
    """Builtin types only (numbers from our breakdown may be numpy scalars); NaN/inf become None."""
    if isinstance(x, dict):
        return {str(k): _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    if x is None or isinstance(x, (bool, str)):
        return x
    if isinstance(x, numbers.Integral):
        return int(x)
    if isinstance(x, numbers.Real):
        return float(x) if math.isfinite(x) else None
    return str(x)


def hta_extras(d: Diagnosis, res: HtaResult, *, budget_mb: float, timeout_s: float) -> dict:
    """The JSON-able `extras['hta']` for this diagnosis and HTA result (builtin types only)."""
    return _plain(_hta_extras(d, res, budget_mb=budget_mb, timeout_s=timeout_s))


def _hta_extras(d: Diagnosis, res: HtaResult, *, budget_mb: float, timeout_s: float) -> dict:
    checks = {c.id: c for c in d.checks}
    out = {"status": res.status, "reason": res.reason, "hta_version": res.version, "ranks": list(res.ranks),
           "steps_kept": list(res.steps), "load_s": res.load_s, "seconds": res.seconds, "budget_mb": budget_mb,
           "timeout_s": timeout_s, "limitations": list(LIMITATIONS)}
    if res.status in ("not_installed", "not_requested"):
        return out
    if res.status != "ok":
        out["by_check"] = {cid: _failed_entry(res.reason, checks.get(cid))
                           for cid in ("exposed_communication", "launch_overhead")}
        return out
    ours_bd = _our_breakdown(d)
    out["analyses"] = {n: "ok" if a.ok else a.error for n, a in res.analyses.items()}
    out["by_check"] = {
        "exposed_communication": _comm_entry(res, ours_bd, checks.get("exposed_communication")),
        "launch_overhead": _launch_entry(res, ours_bd, checks.get("launch_overhead")),
    }
    out["run"] = _run_entry(res, ours_bd)
    out["critical_path"] = _critical_path_entry(res)
    return out
