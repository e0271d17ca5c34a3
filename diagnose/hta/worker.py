"""The child process that runs Holistic Trace Analysis (HTA) on staged traces.

Run as `python -m diagnose.hta.worker SPEC_JSON RESULT_JSON` by `diagnose.hta.runner`, never
imported by the parent (HTA's import is heavy and its loader forks). SPEC_JSON holds
{"trace_dir": ..., "files": {rank: file name}, "critical_path": bool}. RESULT_JSON is
rewritten atomically after each analysis, so a parent that kills this process on its
time limit still reads what finished. Every value written is a plain JSON number, string,
list or dict: DataFrames stay in this process.

Each analysis is wrapped: an HTA exception becomes that analysis's `error` string, the
others still run. Units: HTA reports microseconds; so does this file.
"""
from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import sys
import time
import warnings

ANALYSES = ("temporal", "overlap", "idle", "launch", "critical_path")
STALL_ENV = "DIAGNOSE_HTA_WORKER_STALL"
"""Test hook: the worker hangs before the analysis this names, as a slow HTA would."""


def _num(x) -> float | None:
    try:
        v = float(x)
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None


def _write(path: str, result: dict) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(result, f, allow_nan=False, default=str)
    os.replace(tmp, path)


def _reason(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _temporal(ta) -> dict:
    df = ta.get_temporal_breakdown(visualize=False)
    cols = {"idle_us": "idle_time(us)", "compute_us": "compute_time(us)",
            "non_compute_us": "non_compute_time(us)", "kernel_span_us": "kernel_time(us)"}
    return {str(int(rank)): {k: _num(df[c].iloc[i]) for k, c in cols.items()}
            for i, rank in enumerate(df["rank"])}


def _overlap(ta) -> dict:
    df = ta.get_comm_comp_overlap(visualize=False)
    # HTA returns the percentage only (the ratio column is dropped); NaN when a rank has no comm kernels
    return {str(int(r)): None if _num(v) is None else _num(v) / 100
            for r, v in zip(df["rank"], df["comp_comm_overlap_pctg"])}


def _stream_kernel_time(ta, rank: int) -> dict[str, dict[str, float]]:
    """Per stream: busy time of HTA's COMPUTATION kernels and of all kernels (us, summed)."""
    from hta.utils.utils import get_kernel_type

    df = ta.t.get_trace(rank)
    k = df[df["stream"].ne(-1)]
    names = ta.t.symbol_table.get_sym_table()
    kinds = k["name"].map(lambda i: get_kernel_type(names[i]))
    out: dict[str, dict[str, float]] = {}
    for stream, grp in k.groupby("stream"):
        comp = grp[kinds.loc[grp.index].eq("COMPUTATION")]
        out[str(int(stream))] = {"kernel_us": float(grp["dur"].sum()), "compute_kernel_us": float(comp["dur"].sum()),
                                 "kernels": int(len(grp))}
    return out


def _idle(ta, ranks: list[int]) -> dict:
    df, _ = ta.get_idle_time_breakdown(ranks=ranks, visualize=False)
    out: dict[str, dict] = {}
    for rank in ranks:
        streams = _stream_kernel_time(ta, rank)
        sub = df[df["rank"].eq(rank)]
        for row in sub.itertuples(index=False):
            s = streams.setdefault(str(int(row.stream)), {"kernel_us": 0.0, "compute_kernel_us": 0.0, "kernels": 0})
            s[f"{row.idle_category}_us"] = _num(row.idle_time) or 0.0
        out[str(rank)] = streams
    return out


def _launch(ta, ranks: list[int]) -> dict:
    stats = ta.get_cuda_kernel_launch_stats(ranks=ranks, visualize=False)
    out = {}
    for rank, df in stats.items():
        if df is None or df.empty:
            out[str(int(rank))] = {"kernels": 0}
            continue
        out[str(int(rank))] = {
            "kernels": int(len(df)),
            "median_launch_delay_us": _num(df["launch_delay"].median()),
            "p95_launch_delay_us": _num(df["launch_delay"].quantile(0.95)),
            "median_cpu_launch_us": _num(df["cpu_duration"].median()),
            "median_gpu_duration_us": _num(df["gpu_duration"].median()),
            "share_gpu_shorter_than_launch": _num((df["gpu_duration"] < df["cpu_duration"]).mean()),
        }
    return out


def _critical_path(ta, ranks: list[int], steps: list[int]) -> dict:
    rank = ranks[0]
    # HTA advises against the first step (missing events); instance ids count from 0.
    instance = 1 if len(steps) >= 2 else 0
    res = ta.critical_path_analysis(rank=rank, annotation="ProfilerStep", instance_id=instance)
    if res is None:
        raise ValueError("no ProfilerStep annotation in the trace to bound the critical path")
    graph, ok = res
    if not ok:
        raise ValueError("HTA could not build a critical path for this step")
    edf = graph.get_critical_path_breakdown()
    if edf is None or edf.empty or float(edf["duration"].sum()) <= 0:
        raise ValueError("the critical path is empty")
    total = float(edf["duration"].sum())
    by = edf.groupby("bound_by")["duration"].sum() / total
    sym = ta.t.symbol_table.get_sym_id_map()
    has_sync = "cuda_sync" in sym
    return {"rank": rank, "step_instance": instance, "path_us": total,
            "bound_by": {str(k) or "unattributed": round(float(v), 4) for k, v in by.items()},
            "has_cuda_sync_events": has_sync}


def run(spec: dict, result_path: str) -> int:
    result: dict = {"started": time.time(), "analyses": {}, "steps": [], "ranks": []}
    _write(result_path, result)
    try:
        import hta
        from hta.trace_analysis import TraceAnalysis
    except ImportError as exc:
        result["import_error"] = _reason(exc)
        _write(result_path, result)
        return 3
    result["hta_version"] = getattr(hta, "__version__", None)
    logging.getLogger("hta").setLevel(logging.ERROR)
    files = {int(r): f for r, f in spec["files"].items()}
    t0 = time.perf_counter()
    try:
        ta = TraceAnalysis(trace_files=files, trace_dir=spec["trace_dir"])
    except BaseException as exc:  # HTA raises anything from AssertionError to KeyError on odd traces
        result["load_error"] = _reason(exc)
        _write(result_path, result)
        return 4
    result["load_s"] = round(time.perf_counter() - t0, 3)
    ranks = sorted(int(r) for r in ta.t.traces)
    result["ranks"] = ranks
    try:
        result["steps"] = [int(s) for s in ta.get_profiler_steps()]
    except Exception:  # noqa: BLE001 - the step list is informational
        result["steps"] = []
    _write(result_path, result)
    if not ranks:
        result["load_error"] = "HTA found no analysable events in any trace"
        _write(result_path, result)
        return 4
    if not any(ta.t.get_trace(r)["stream"].ge(0).any() for r in ranks):
        # HTA's analyses would raise IndexError/ValueError or return NaN here: say why instead
        result["no_gpu"] = "it holds no GPU kernels (a CPU-only trace?); HTA's analyses measure GPU streams"
        _write(result_path, result)
        return 4
    jobs = {
        "temporal": lambda: _temporal(ta),
        "overlap": lambda: _overlap(ta),
        "idle": lambda: _idle(ta, ranks),
        "launch": lambda: _launch(ta, ranks),
    }
    if spec.get("critical_path", True):
        jobs["critical_path"] = lambda: _critical_path(ta, ranks, result["steps"])
    stall = os.environ.get(STALL_ENV)
    for name, job in jobs.items():
        if stall == name:
            time.sleep(3600)  # tests: lets the parent's time limit land between two analyses
        t1 = time.perf_counter()
        try:
            result["analyses"][name] = {"ok": True, "data": job()}
        except BaseException as exc:  # noqa: BLE001 - one analysis failing must not cost the others
            result["analyses"][name] = {"ok": False, "error": _reason(exc)}
        result["analyses"][name]["seconds"] = round(time.perf_counter() - t1, 3)
        _write(result_path, result)
    return 0


def main(argv: list[str]) -> int:
    spec_path, result_path = argv[1], argv[2]
    with open(spec_path, encoding="utf-8") as f:
        spec = json.load(f)
    warnings.simplefilter("ignore")
    # HTA prints (critical path summary, progress): keep it in the log, off our result file
    with contextlib.redirect_stdout(sys.stderr):
        return run(spec, result_path)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
