"""How fast and how lean is `diagnose analyze` on real trace sizes?

Builds large, realistic traces by replicating the events of a real GPU trace (default:
../shared/traces/hta_nccl_data_rank0of2_a100, an A100 NCCL job), re-timed copy after
copy with unique correlation/flow ids, into a temporary directory:

- one rank of --big-mb MB (uncompressed) with many steps (3 per copy of the source),
- the same size with --few-steps steps (each spans many copies),
- --ranks ranks of --rank-mb MB each,

then times, in the same run and each in its own child process (so peaks do not mix):

- floor: the raw parse: read + gunzip + orjson.loads with the collector paused, one process
  for one file; for several ranks, two processes (this machine's cores) sharing the files;
- diagnose: diagnose.pipeline.diagnose_paths, end to end (parse, timelines, checks);
- hta: HTA's TraceAnalysis(trace_dir=...) load, if `hta` imports.

Prints wall times, ratios to the floor and peak resident memory (the process's own
ru_maxrss and its largest worker's).

    python benchmarks/bench_ingest.py                  # 200 MB, 200 MB few steps, 8 x 50 MB
    python benchmarks/bench_ingest.py --quick          # 40 MB, 40 MB, 4 x 20 MB (under 2 minutes)
    python benchmarks/bench_ingest.py --sweep 2,8,32 --sweep-only   # memory against the rank count
"""
from __future__ import annotations

import argparse
import gzip
import importlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import orjson

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT.parent / "shared" / "traces" / "hta_nccl_data_rank0of2_a100" / "nccl_data.json.gz"
ID_STRIDE = 10_000_000


# -- building traces -----------------------------------------------------------------------

def load_source(path: Path) -> tuple[dict, list]:
    doc = orjson.loads(gzip.decompress(path.read_bytes()))
    return doc, doc.pop("traceEvents")


def _span(events: list) -> tuple[float, float]:
    xs = [e for e in events if e.get("ph") == "X" and isinstance(e.get("ts"), (int, float))]
    return min(e["ts"] for e in xs), max(e["ts"] + e.get("dur", 0) for e in xs)


def _is_step(e: dict) -> bool:
    return str(e.get("name", "")).startswith("ProfilerStep#")


def copy_events(events: list, i: int, dt: float, steps_per_copy: int, keep_steps: bool, jitter: float) -> list:
    """Copy i of the source events, shifted in time, with unique ids and step numbers."""
    out = []
    shift = i * dt + jitter
    for e in events:
        if not keep_steps and _is_step(e):
            continue
        c = dict(e)
        if isinstance(c.get("ts"), (int, float)) and c.get("ph") != "M":
            c["ts"] = c["ts"] + shift
        if "id" in c and isinstance(c["id"], int):
            c["id"] += i * ID_STRIDE
        a = c.get("args")
        if isinstance(a, dict):
            a = dict(a)
            for k in ("correlation", "External id", "Ev Idx"):
                if isinstance(a.get(k), int):
                    a[k] += i * ID_STRIDE
            c["args"] = a
        if keep_steps and _is_step(c):
            n = int(c["name"].split("#")[1])
            c["name"] = f"ProfilerStep#{n + i * steps_per_copy}"
        if c.get("ph") == "M" and i > 0:
            continue  # process/thread names once
        out.append(c)
    return out


def build_trace(path: Path, meta: dict, events: list, target_mb: float, *, rank: int, world: int,
                few_steps: int | None, jitter: float) -> dict:
    """Write one rank's trace of about target_mb uncompressed MB; returns its facts."""
    lo, hi = _span(events)
    dt = (hi - lo) + 1000.0
    steps_per_copy = sum(1 for e in events if _is_step(e) and e.get("cat") in ("cpu_op", "user_annotation"))
    per_copy = len(orjson.dumps(events))
    copies = max(1, round(target_mb * 1e6 / per_copy))
    head = {**meta, "distributedInfo": {**(meta.get("distributedInfo") or {}), "rank": rank, "world_size": world}}
    size = n_events = 0
    with gzip.open(path, "wb", compresslevel=1) as f:
        def put(b: bytes) -> None:
            nonlocal size
            f.write(b)
            size += len(b)

        put(b"{\n" + b"".join(b'  "%s": %s,\n' % (k.encode(), orjson.dumps(v)) for k, v in head.items()
                              if k not in ("traceName",)))
        put(b'  "traceEvents": [\n')
        first = True
        for i in range(copies):
            evs = copy_events(events, i, dt, steps_per_copy, keep_steps=few_steps is None, jitter=jitter)
            if few_steps is not None:
                block = max(1, copies // few_steps)
                if i % block == 0 and i // block < few_steps:
                    start = lo + i * dt + jitter
                    length = min(block, copies - i) * dt - 500.0
                    evs.append({"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{i // block}",
                                "pid": evs[0].get("pid", 0), "tid": _main_tid(events), "ts": start, "dur": length})
            n_events += len(evs)
            body = b",\n".join(b"  " + orjson.dumps(e) for e in evs)
            put((b"" if first else b",\n") + body)
            first = False
        put(b'\n  ],\n  "traceName": "bench"\n}\n')
    n_steps = few_steps if few_steps is not None else copies * steps_per_copy
    return {"file": str(path), "mb": size / 1e6, "events": n_events, "steps": n_steps}


def _main_tid(events: list):
    for e in events:
        if _is_step(e) and e.get("cat") in ("cpu_op", "user_annotation"):
            return e.get("tid")
    return 1


def build_scenarios(out: Path, source: Path, big_mb: float, few: int, ranks: int, rank_mb: float) -> dict:
    # a kept --dir built with the same parameters is reused (building takes longer than measuring)
    manifest = out / "manifest.json"
    params = [str(source), big_mb, few, ranks, rank_mb]
    if manifest.exists():
        kept = json.loads(manifest.read_text())
        if kept.get("params") == params and all(Path(f["file"]).exists()
                                                for s in kept["scenarios"].values() for f in s["files"]):
            return kept["scenarios"]
        raise SystemExit(f"{out} holds traces built with other parameters: remove it or pick another --dir")
    meta, events = load_source(source)
    scen = {}
    for name, mb, n_ranks, few_steps in (("one rank, many steps", big_mb, 1, None),
                                         (f"one rank, {few} steps", big_mb, 1, few),
                                         (f"{ranks} ranks", rank_mb, ranks, None)):
        d = out / name.replace(" ", "_").replace(",", "")
        d.mkdir(parents=True)
        files = [build_trace(d / f"rank{r}.pt.trace.json.gz", meta, events, mb, rank=r, world=max(n_ranks, 2),
                             few_steps=few_steps, jitter=r * 3.0) for r in range(n_ranks)]
        scen[name] = {"dir": str(d), "files": files}
    manifest.write_text(json.dumps({"params": params, "scenarios": scen}))
    return scen


# -- measuring (each in a child process) ---------------------------------------------------

def _parse_one(path: str) -> int:
    import gc

    gc.disable()
    with open(path, "rb") as f:
        doc = orjson.loads(gzip.decompress(f.read()))
    n = len(doc["traceEvents"])
    gc.enable()
    return n


def _own_peak_mb() -> float:
    """This process's peak resident memory since exec.

    Not ru_maxrss: Linux carries the high-water mark of the image replaced by exec (here,
    a fork of the benchmark holding the built traces) into the new one.
    """
    import resource

    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def measure(kind: str, target: str, workers: int) -> dict:
    import resource

    files = sorted(str(p) for p in Path(target).iterdir() if p.name.endswith(".json.gz"))
    # imports are paid once per command, not per megabyte: outside the timing (reported apart)
    t = time.perf_counter()
    module = {"diagnose": "diagnose.pipeline", "baseline": "diagnose.pipeline",
              "hta": "hta.trace_analysis"}.get(kind)
    if module:
        importlib.import_module(module)
    imports = time.perf_counter() - t
    t = time.perf_counter()
    if kind == "floor":
        if workers > 1 and len(files) > 1:
            from concurrent.futures import ProcessPoolExecutor

            with ProcessPoolExecutor(workers) as pool:
                list(pool.map(_parse_one, files))
        else:
            for f in files:
                _parse_one(f)
    elif kind == "diagnose":
        from diagnose.pipeline import diagnose_paths

        d = diagnose_paths([target])
        assert d.run.steps_analysed >= 1
    elif kind == "hta":
        from hta.trace_analysis import TraceAnalysis

        TraceAnalysis(trace_dir=target)
    # kind == "baseline": the interpreter and diagnose's imports alone, for reading the peaks
    wall = time.perf_counter() - t
    own = _own_peak_mb()
    kids = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    return {"wall_s": wall, "peak_mb": own, "worker_peak_mb": kids, "import_s": imports}


def run_child(kind: str, target: str, workers: int, timeout: float) -> dict | None:
    cmd = [sys.executable, __file__, "--measure", kind, "--target", target, "--workers", str(workers)]
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    if res.returncode != 0:
        return {"error": (res.stderr.strip().splitlines() or ["failed"])[-1][:200]}
    return json.loads(res.stdout.strip().splitlines()[-1])


def hta_available() -> bool:
    return importlib.util.find_spec("hta") is not None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--big-mb", type=float, default=200)
    ap.add_argument("--few-steps", type=int, default=4)
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--rank-mb", type=float, default=50)
    ap.add_argument("--quick", action="store_true", help="40 MB, 40 MB, 4 x 20 MB")
    ap.add_argument("--source", type=Path, default=SOURCE)
    ap.add_argument("--dir", type=Path, help="build here and keep (default: a temporary directory, removed)")
    ap.add_argument("--repeat", type=int, default=3, help="runs per measurement (interleaved); the fastest is "
                    "reported")
    ap.add_argument("--sweep", default="", help="also: rank counts (e.g. 2,8,32) of --sweep-mb MB each, to show "
                    "that diagnose's parent memory does not grow with the rank count")
    ap.add_argument("--sweep-mb", type=float, default=6)
    ap.add_argument("--sweep-only", action="store_true", help="run only the rank sweep")
    ap.add_argument("--no-hta", action="store_true")
    ap.add_argument("--hta-timeout", type=float, default=600)
    ap.add_argument("--measure", help=argparse.SUPPRESS)
    ap.add_argument("--target", help=argparse.SUPPRESS)
    ap.add_argument("--workers", type=int, default=1, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.measure:
        print(json.dumps(measure(a.measure, a.target, a.workers)))
        return 0
    if a.quick:
        a.big_mb, a.ranks, a.rank_mb, a.repeat = 40, 4, 20, 1
    if not a.source.exists():
        print(f"source trace {a.source} not found (needs ../shared/traces)")
        return 1
    cores = os.cpu_count() or 1
    base = a.dir or Path(tempfile.mkdtemp(prefix="bench_ingest_"))
    try:
        t = time.perf_counter()
        scen = {} if a.sweep_only else build_scenarios(base, a.source, a.big_mb, a.few_steps, a.ranks, a.rank_mb)
        sweep = build_sweep(base, a.source, [int(x) for x in a.sweep.split(",") if x], a.sweep_mb)
        print(f"built traces in {time.perf_counter() - t:.0f} s under {base} ({cores} cores)\n")
        base_rss = run_child("baseline", str(base), 1, 120)
        print(f"baseline: the interpreter with diagnose imported (numpy, pandas) peaks at "
              f"{base_rss.get('peak_mb', float('nan')):.0f} MB before reading anything\n")
        if sweep:
            _print_sweep(sweep, base_rss.get("peak_mb", float("nan")), a.repeat)
        with_hta = not a.no_hta and hta_available()
        if not with_hta and not a.no_hta:
            print("HTA not installed: pip install traceinsight\n")
        for name, s in scen.items():
            files = s["files"]
            mb = sum(f["mb"] for f in files)
            biggest = max(f["mb"] for f in files)
            workers = min(cores, len(files))
            kinds = ["floor", "diagnose"] + (["hta"] if with_hta else [])
            runs: dict[str, list] = {k: [] for k in kinds}
            for i in range(a.repeat):  # interleaved, so a busy moment on a shared machine hits both
                for kind in kinds:
                    if kind == "hta" and i > 0:
                        continue  # HTA is slow enough that one run tells
                    runs[kind].append(run_child(kind, s["dir"], workers,
                                                a.hta_timeout if kind == "hta" else 1800))
            res = {}
            for kind, rs in runs.items():
                ok = [r for r in rs if r and "error" not in r]
                res[kind] = min(ok, key=lambda r: r["wall_s"]) if ok else rs[0]
            _print_row(name, files, mb, biggest, res)
        return 0
    finally:
        if a.dir is None:
            shutil.rmtree(base, ignore_errors=True)


def build_sweep(out: Path, source: Path, counts: list[int], mb: float) -> dict[int, str]:
    """One directory of `n` ranks of `mb` MB each per count (reused when already built)."""
    if not counts:
        return {}
    meta, events = load_source(source)
    dirs = {}
    for n in counts:
        d = out / f"sweep_{n}x{mb:g}MB"
        if not (d / "done").exists():
            shutil.rmtree(d, ignore_errors=True)
            d.mkdir(parents=True)
            for r in range(n):
                build_trace(d / f"rank{r}.pt.trace.json.gz", meta, events, mb, rank=r, world=n, few_steps=None,
                            jitter=r * 3.0)
            (d / "done").write_text("")
        dirs[n] = str(d)
    return dirs


def _print_sweep(sweep: dict[int, str], baseline_mb: float, repeat: int) -> None:
    print("rank sweep: diagnose analyze's peak memory against the rank count "
          f"(baseline {baseline_mb:.0f} MB = the interpreter with diagnose imported)")
    workers = min(os.cpu_count() or 1, 2)
    for n, d in sweep.items():
        runs = [run_child("diagnose", d, workers, 1800) for _ in range(repeat)]
        ok = [r for r in runs if r and "error" not in r]
        if not ok:
            print(f"  {n:4d} ranks: {(runs[0] or {}).get('error', 'failed')}")
            continue
        r = min(ok, key=lambda x: x["wall_s"])
        print(f"  {n:4d} ranks: {r['wall_s']:6.2f} s, parent peak {r['peak_mb']:5.0f} MB "
              f"({r['peak_mb'] - baseline_mb:+5.0f} MB over the baseline), largest worker {r['worker_peak_mb']:5.0f} MB")
    print()


def _fmt(r: dict | None, floor: dict | None, biggest: float) -> str:
    if not r or "error" in r:
        return f"{(r or {}).get('error', 'n/a')}"
    ratio = r["wall_s"] / floor["wall_s"] if floor and "wall_s" in floor else float("nan")
    peak = max(r["peak_mb"], r["worker_peak_mb"])
    return (f"{r['wall_s']:7.2f} s ({ratio:4.2f}x floor), peak {r['peak_mb']:6.0f} MB"
            f" (workers {r['worker_peak_mb']:5.0f} MB; {peak / biggest:4.2f}x the largest trace)"
            + (f" [+{r['import_s']:.2f} s imports]" if r.get("import_s", 0) > 0.05 else ""))


def _print_row(name: str, files: list, mb: float, biggest: float, res: dict) -> None:
    ev = sum(f["events"] for f in files)
    steps = files[0]["steps"]
    print(f"{name}: {len(files)} file(s), {mb:.0f} MB uncompressed (largest {biggest:.0f} MB), "
          f"{ev:,} events, {steps} steps per rank")
    floor = res.get("floor")
    for kind, label in (("floor", "raw parse (floor)"), ("diagnose", "diagnose analyze"), ("hta", "HTA load")):
        if kind in res:
            print(f"  {label:18s} {_fmt(res[kind], floor, biggest)}")
    print()


if __name__ == "__main__":
    raise SystemExit(main())
