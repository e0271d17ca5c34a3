"""What a diagnosis becomes: diagnosis.json, the terminal summary, and (analyze_outputs, the shared
tail of `analyze`, `run` and `capture`) the report beside them. No verdicts are computed here; the
launcher and the CLI both call down to this module, never into each other."""
from __future__ import annotations

import math
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import click
import orjson

from diagnose import __version__
from diagnose.errors import DiagnoseError, one_line
from diagnose.model import Diagnosis, Grid
from diagnose.probes.safefs import write_atomic  # the one safe writer, shared with the probes
from diagnose.units import human, on_ranks, rank_ranges


def _clean(x):
    """JSON has no NaN/inf: write null. Non-UTF-8 bytes in file names (surrogates) become U+FFFD.
    A Grid (a matrix the Diagnosis holds as one array until written) becomes lists.
    What needs no change is returned as it is, not copied: a copy of the report's timeline lanes (a
    list a bar) was most of the JSON's memory (diagnosis_dict)."""
    if isinstance(x, Grid):
        return _clean(x.tolist())
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, str):
        if x.isascii():  # no surrogate in it
            return x
        y = x.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
        return x if y == x else y
    if isinstance(x, dict):
        values = [_clean(v) for v in x.values()]
        if all(type(k) is str for k in x) and all(a is b for a, b in zip(values, x.values())):
            return x
        return {str(k): v for k, v in zip(x, values)}
    if isinstance(x, (list, tuple)):
        items = [_clean(v) for v in x]
        return x if type(x) is list and all(a is b for a, b in zip(items, x)) else items
    return x


JSON_OPTIONS = orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY
"""diagnosis.json's layout: two spaces an indent level, numpy's scalars and arrays as numbers."""
PIECE_ITEMS = 64
"""A list or dict of more items than this (a rank's or a row's each) is written an item at a time
(json_parts), as is every list and dict of the document's first PIECE_LEVELS levels."""
PIECE_LEVELS = 4
"""Deep enough that what orjson writes whole is one rank's part of an extra (the report's timeline
lanes: 16 ranks of ~30 KB each for a DLRM rank, written whole they were 0.5 MB and its indented copy)."""


class RowDicts(Sequence):
    """The breakdown as diagnosis.json holds it, each row's dict made when read: the writers (JSON,
    report) read it a row at a time, so a run's rows (a rank's every step) are never all dicts at
    once; as a list they were the report's largest growth with the ranks (#20)."""

    __slots__ = ("_rows",)

    def __init__(self, rows: Sequence) -> None:
        self._rows = rows

    def __len__(self) -> int:
        return len(self._rows)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [_clean(asdict(s)) for s in self._rows[i]]
        return _clean(asdict(self._rows[i]))

    def __iter__(self):
        return (_clean(asdict(s)) for s in self._rows)


def diagnosis_dict(d: Diagnosis, rows_when_read: bool = False) -> dict:
    """The Diagnosis as diagnosis.json holds it. Its extras are the Diagnosis's own dicts and
    lists wherever they are already JSON (not copied: read it, do not change it): copied twice
    (asdict, then _clean), the report's timeline lanes alone took the JSON's making 13 MB above
    the analysis at 256 ResNet-50 ranks, against 1 now (docs/cluster-memory-log.md).
    rows_when_read: the breakdown a RowDicts (each row made as it is read), not a list."""
    body = asdict(replace(d, breakdown=(), extras={}))  # the rows one at a time below, not deep-copied first
    rows = RowDicts(d.breakdown)
    return _clean({
        "schema_version": d.schema_version,
        "tool": {"name": "torch-diagnose", "version": __version__},
        "verdict": _verdict(d),
        "run": body["run"],
        "findings": body["findings"],
        # a check keeps its numbers even when it passed: "why not flagged" is evidence too
        "checks": [{**{k: v for k, v in c.items() if k != "finding"},
                    "metrics": c["finding"]["metrics"] if c.get("finding") else {}} for c in body["checks"]],
        "breakdown": rows if rows_when_read else list(rows),
        "warnings": body["warnings"],
        "skipped": body["skipped"],
        "extras": d.extras,
    })


def json_parts(x, depth: int = 0) -> Iterator[bytes]:
    """`x` as orjson.dumps(_clean(x), option=JSON_OPTIONS) writes it, byte for byte, in pieces:
    the document's first levels and every long list or dict an item at a time (a RowDicts a
    row at a time, a Grid a row at a time), the rest by orjson whole. diagnosis.json made as one
    text was held whole beside the answer: 3.6 MB above it at 1,024 DLRM ranks, 1.4 at 256 (#20).
    `depth`: the indent level `x` is written at."""
    if isinstance(x, Grid) and x.values.ndim == 2:
        items, n = (row.tolist() for row in x.values), len(x.values)
    elif isinstance(x, (list, tuple, RowDicts)):
        items, n = iter(x), len(x)
    else:
        items, n = None, len(x) if isinstance(x, dict) else 0
    if not n or (depth >= PIECE_LEVELS and n <= PIECE_ITEMS):  # a leaf, or small enough to write whole
        text = orjson.dumps(_clean(x), option=JSON_OPTIONS)
        yield text.replace(b"\n", b"\n" + b"  " * depth) if depth else text
        return
    pad, sep = b"\n" + b"  " * (depth + 1), b"[" if items is not None else b"{"
    if items is None:
        # non-text keys as _clean writes them (str(k)): a collision keeps the first place, the last value
        items = (x if all(type(k) is str for k in x) else {str(k): v for k, v in x.items()}).items()
        for k, v in items:
            yield sep + pad + orjson.dumps(k) + b": "
            yield from json_parts(v, depth + 1)
            sep = b","
        yield b"\n" + b"  " * depth + b"}"
        return
    for v in items:
        yield sep + pad
        yield from json_parts(v, depth + 1)
        sep = b","
    yield b"\n" + b"  " * depth + b"]"


def _reason(d: Diagnosis, check_id: str) -> str:
    return next((c.reason for c in d.checks if c.id == check_id), "")


def _verdict(d: Diagnosis) -> str:
    f = d.top
    if f is None:
        return "no significant cause found: every check passed or could not be measured"
    if f.kind == "capacity":
        return f"{f.title}: {_reason(d, f.id)}"
    return (f"{f.title}: {f.recoverable_ms:.1f} ms per step ({f.share_of_step:.0%}) recoverable"
            f" on {on_ranks(f.ranks, d.run.ranks_found)}")


def write_json(d: Diagnosis, out_dir: Path) -> Path:
    path = out_dir / "diagnosis.json"
    write_atomic(path, lambda: json_parts(diagnosis_dict(d, rows_when_read=True)))
    return path


def _window_of(d: Diagnosis) -> str:
    """' (profiled window K of N)' where the traces were one run's repeated windows, else ''."""
    pw = d.extras.get("profiled_windows") or {}
    return f" (profiled window {pw['analysed']} of {pw['written']})" if pw.get("written", 1) > 1 else ""


def terminal_summary(d: Diagnosis) -> str:
    """The summary `analyze` prints. Titles, reasons, fixes, device names and warnings carry trace
    text (op names, file names, metadata), which is untrusted: every line goes through one
    sanitiser (`one_line`), so an escape sequence is shown escaped, never acted on by the terminal."""
    r = d.run
    lines = []
    f = d.top
    if f is None:
        lines.append("VERDICT: no significant cause found (every check passed or was not measurable).")
    else:
        lines.append(f"VERDICT: {f.title}")
        if f.kind == "capacity":
            lines.append(f"  {_reason(d, f.id)} (capacity: no step time lost), confidence {f.confidence}")
        else:
            lines.append(f"  {f.recoverable_ms:.1f} ms per step recoverable ({f.share_of_step:.0%} of the step), "
                         f"{on_ranks(f.ranks, r.ranks_found)}, confidence {f.confidence}")
        lines.append(f"  fix: {f.fix}")
    if r.ranks_missing and (f is None or f.kind != "capacity"):  # beside the verdict, not only in the warnings
        lines.append(f"  caution: {len(r.ranks_found)} of {r.world_size} ranks here (rank(s) "
                     f"{rank_ranges(r.ranks_missing)} missing): a cause there is not seen, and waiting for them reads "
                     "as communication here; analyse every rank's traces together")
    waited = d.extras.get("unnamed_wait")
    if waited and f is None:
        from diagnose.step.breakdown import unnamed_wait_caution

        lines.append(f"  caution: {unnamed_wait_caution(waited)}")
    window = d.extras.get("window") or {}
    if window.get("unlike") and (f is None or f.kind != "capacity"):  # "nothing found" from an unusual window too
        from diagnose.step.window import caution

        lines.append(f"  caution: {one_line(caution(window))}")
    found = len(r.ranks_found)
    ws = r.world_size or found
    mean = sum(r.mean_step_ms.values()) / max(len(r.mean_step_ms), 1)
    lines.append("")
    backend = r.backend or ("none (single process)" if ws == 1 else "?")
    lines.append(f"run: {found} of {ws} ranks, backend {backend}, device {r.device}"
                 f"{' (' + r.device_name + ')' if r.device_name else ''}, "
                 f"{r.steps_analysed} step(s) from {r.step_source}{_window_of(d)}, mean step {mean:.1f} ms")
    compiled = (d.extras.get("compiled") or {}).get("host_share")
    if compiled is not None:
        lines.append(f"torch.compile: {compiled:.0%} of the host's time in the steps runs inside compiled code")
    evaluation = d.extras.get("evaluation") or {}
    if evaluation.get("ms_per_step"):
        lines.append(f"evaluation: {evaluation['ms_per_step']:.1f} ms per step ({evaluation['share_of_step']:.0%}) "
                     "of the profiled steps is an evaluation's loop over its DataLoader (its batches and forward "
                     "passes) inside the training steps")
    if d.findings:
        lines.append("")
        lines.append("ranked causes:")
        for i, x in enumerate(d.findings, 1):
            lines.append(f"  {i}. {x.id:<24} {x.recoverable_ms:9.2f} ms/step {x.share_of_step:6.1%}  "
                         f"{on_ranks(x.ranks, r.ranks_found)}  [{x.severity}, {x.confidence} confidence]")
    lines.append("")
    lines.append("checklist:")
    for c in d.checks:
        lines.append(f"  [{c.status:^14}] {c.id}: {c.reason}")
    groups = (d.extras.get("comm_groups") or {}).get("groups") or []
    if groups:
        lines.append("")
        lines.append("communication by group (exposed ms per step on the median rank; medians of size, transfer "
                     "and nccl-tests' bus bandwidth where sizes are recorded):")
        for g in groups[:8]:
            name = f"group {g['group']} ({g['ranks']} ranks) {g['kind']} x{g['count']}" if g["group"] else g["kind"]
            line = f"  {name}: {g['exposed_ms_per_step']:.2f} ms exposed"
            if g["sized"]:
                bus = f"{g['busbw_gbps']:.2f} GB/s bus" if g["busbw_gbps"] is not None else "no bus bandwidth"
                wait = "; includes waits: one rank loaded" if g["transfer"].startswith("own") else ""
                line += (f"; {human(g['median_bytes'])} in {g['median_transfer_ms']:.2f} ms, {bus} "
                         f"[{g['regime']}{wait}]")
            if g.get("link_verdict") in ("near peak", "below peak", "far below"):
                line += f"; {g['link_verdict']}: {g['link_share']:.0%} of {g['link_gbps']:g} GB/s ({g['link']} link)"
            elif g.get("link_verdict") == "lower bound":
                line += f"; at least {g['link_share']:.0%} of {g['link_gbps']:g} GB/s ({g['link']} link): no verdict"
            if g.get("tp_spans_hosts"):
                line += f"; a tensor-parallel-sized group over {g['hosts']} hosts"
            lines.append(line)
        if any(g.get("link_verdict") == "link unknown" for g in groups):
            lines.append("  against the link: no verdict; " + next(
                g["link_text"].split("no verdict on the link: ", 1)[-1] for g in groups
                if g.get("link_verdict") == "link unknown"))
    if d.warnings:
        lines.append("")
        lines.append("warnings:")
        lines += [f"  - {w}" for w in d.warnings[:20]]
        if len(d.warnings) > 20:
            lines.append(f"  ... and {len(d.warnings) - 20} more (see diagnosis.json)")
    return "\n".join(one_line(line) for line in lines)


# ---- the shared tail of every diagnosing command (analyze, run, capture): diagnose, write, print ----
class ProgressLine:
    """'reading traces: 3/8 ranks, 12.4 s' on one rewritten stderr line, for loads that take a
    while (nothing for the first second); only on a terminal, so logs and pipes stay clean."""

    def __init__(self, after_s: float = 1.0) -> None:
        self.t0 = time.monotonic()
        self.after_s = after_s
        self.shown = False

    def __call__(self, done: int, total: int, name: str) -> None:
        elapsed = time.monotonic() - self.t0
        if elapsed < self.after_s and not self.shown:
            return
        self.shown = True
        click.echo(f"\rreading traces: {done}/{total} ranks, {elapsed:.1f} s (last: {one_line(name)[:60]})\x1b[K",
                   err=True, nl=False)

    def close(self) -> None:
        if self.shown:
            click.echo("\r\x1b[K", err=True, nl=False)


@dataclass(frozen=True, slots=True)
class HtaOptions:
    budget_mb: float = 256.0
    timeout_s: float = 180.0


def analyze_outputs(paths: list[str], out: Path, max_trace_gb: float = 8.0, jobs: int | None = None,
                    echo: bool = True, hta: HtaOptions | None = None, probe_paths: list[str] | None = None,
                    link=None, cluster: str | None = None, window: int | None = None,
                    run_k: int | None = None) -> Diagnosis:
    """The shared tail of every diagnosing command; raises DiagnoseError on bad input. cluster: a
    Dask scheduler's address (or local:N) whose workers list and read `paths`. Returns what it wrote."""
    from diagnose.output import terminal_summary, write_json
    from diagnose.pipeline import diagnose_paths

    progress = ProgressLine() if echo and sys.stderr.isatty() else None
    try:
        if cluster is None:
            d = diagnose_paths(paths, max_bytes=int(max_trace_gb * 1024**3), jobs=jobs, progress=progress,
                               probe_paths=probe_paths, link=link, window=window, run_k=run_k)
        else:
            from diagnose.ingest.cluster import connect  # lazily: dask only with --cluster

            with connect(cluster) as reader:
                d = diagnose_paths(paths, max_bytes=int(max_trace_gb * 1024**3), progress=progress,
                                   probe_paths=probe_paths, link=link, reader=reader, window=window,
                                   run_k=run_k)
            said = reader.stats.line()
    finally:
        if progress is not None:
            progress.close()
    if cluster is not None and echo:
        click.echo(said, err=True)
    if hta is not None:
        from diagnose.hta import attach_hta

        d = attach_hta(d, paths, budget_mb=hta.budget_mb, timeout_s=hta.timeout_s)
    try:
        write_json(d, out)
        written = [out / "diagnosis.json"]
        try:
            from diagnose.reports.html import write_report
        except ImportError:
            write_report = None
        if write_report is not None:
            written.append(write_report(d, out))
    except OSError as exc:
        raise DiagnoseError(f"cannot write outputs ({exc.strerror or exc})", out) from None
    if echo:
        click.echo(terminal_summary(d))
        click.echo("")
        if hta is not None:
            from diagnose.hta import hta_summary

            click.echo(hta_summary(d))
            click.echo("")
        click.echo("wrote " + ", ".join(str(p) for p in written))
    return d
