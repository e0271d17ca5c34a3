"""Mutation testing of the checklist (diagnose/analyzers/) with mutmut, on the fast tests.

mutmut (pinned below: its mutant names and state files change between releases) copies the
package into mutants/, rewrites every function of the analyzers into variants (an operator
flipped, a constant nudged, a string changed, a call argument dropped...), and runs, for each
variant, the fast tests that reach that function (the selection is in pyproject.toml,
[tool.mutmut]). A mutant no test notices "survives": a change in what the tool prints that
nothing would catch. tests/conftest.py keys its caches on the mutant under test, so no mutant is
judged by results the unmutated code made.

    python benchmarks/mutation.py            # a random sample of 400 mutants (seed 0), then report
    python benchmarks/mutation.py --sample 0 # every mutant (about 6,000: hours on 2 cores)
    python benchmarks/mutation.py --report   # report the last run only

Prints the score per file and writes docs/mutation.md: the score, and every surviving mutant
with its changed line. Not part of CI (too slow for its budget). Needs `pip install mutmut==3.8.1`.
"""
from __future__ import annotations

import argparse
import datetime
import difflib
import json
import math
import os
import random
import re
import subprocess
import sys
from collections import Counter, defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MUTMUT = "3.8.1"
TARGET = "diagnose/analyzers"
KILLED = {1, 3, 36, -24, 24, 152, 255, -11, -9, 37}  # failed, errored, timed out or crashed: noticed
SURVIVED = {0}
NO_TESTS = {5, 33}


FIRST = "diagnose.analyzers.common.x_flag_or_pass__mutmut_1"
"""One mutant to run first: mutmut then generates every mutant and records which tests reach what."""
SAMPLE_FILE = ROOT / "mutants" / "sample.json"


def run(children: int, sample: int, seed: int) -> None:
    import mutmut

    version = getattr(mutmut, "__version__", None)
    if version and version != MUTMUT:
        sys.exit(f"mutmut {version} found; this script reads the state files of mutmut {MUTMUT}")
    env = {**os.environ, "DIAGNOSE_SHARED_TRACES": str(ROOT.parent / "shared" / "traces")}
    link_mapped_packages()
    cmd = ["mutmut", "run", "--max-children", str(children)]
    if sample <= 0:
        subprocess.run(cmd, cwd=ROOT, env=env, check=False)
        SAMPLE_FILE.unlink(missing_ok=True)
        return
    subprocess.run(cmd + [FIRST], cwd=ROOT, env=env, check=False)
    names = sorted(n for codes in results().values() for n in codes)
    chosen = sorted(random.Random(seed).sample(names, min(sample, len(names))))
    SAMPLE_FILE.write_text(json.dumps({"seed": seed, "of": len(names), "mutants": chosen, "tested": _head()}))
    subprocess.run(cmd + chosen, cwd=ROOT, env=env, check=False)


def run_only(children: int, names: list[str]) -> None:
    """Run the named mutants only (after mutmut has generated them) and print each one's result:
    to check that new tests kill the survivors a sample left, without a new sample."""
    env = {**os.environ, "DIAGNOSE_SHARED_TRACES": str(ROOT.parent / "shared" / "traces")}
    link_mapped_packages()
    cmd = ["mutmut", "run", "--max-children", str(children)]
    subprocess.run(cmd + [FIRST], cwd=ROOT, env=env, check=False)
    known = {n: f for f, codes in results().items() for n in codes}
    missing = [n for n in names if n not in known]
    subprocess.run(cmd + [n for n in names if n in known], cwd=ROOT, env=env, check=False)
    codes = {n: c for f in results().values() for n, c in f.items()}
    for n in names:
        c = codes.get(n)
        state = ("no such mutant (the code changed)" if n in missing else "killed" if c in KILLED
                 else "survived" if c in SURVIVED else "no tests" if c in NO_TESTS else f"exit {c}")
        print(f"{state:12s} {n}")


def link_mapped_packages() -> None:
    """mutmut copies diagnose/ into mutants/ and the tests import it from there, but diagnose.probes,
    .reports and .examples live in other folders (pyproject's package-dir): without these links the
    first import of the probes fails and every mutant is "not run". Links, not copies: those
    folders are not mutated."""
    import tomllib

    dirs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    for name, folder in dirs.items():
        parts = name.split(".")
        if len(parts) < 2 or parts[0] != "diagnose":
            continue
        link = ROOT / "mutants" / Path(*parts)
        link.parent.mkdir(parents=True, exist_ok=True)
        if not link.exists():
            link.symlink_to(ROOT / folder, target_is_directory=True)


def _head() -> str:
    """The commit the run tests (and whether the working tree differed from it), with the date."""
    git = ["git", "-C", str(ROOT)]
    sha = subprocess.run(git + ["rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(git + ["status", "--porcelain", "--untracked-files=no"], capture_output=True,
                           text=True).stdout.strip()
    return f"{sha or 'unknown commit'}{' plus uncommitted changes' if dirty else ''}, {datetime.date.today()}"


def results() -> dict[str, dict[str, int | None]]:
    """{file: {mutant name: exit code}} from mutmut's state files."""
    out = {}
    for meta in sorted((ROOT / "mutants" / TARGET).glob("*.py.meta")):
        data = json.loads(meta.read_text())
        out[meta.name.removesuffix(".meta")] = data["exit_code_by_key"]
    return out


def change(name: str) -> tuple[str, str]:
    """The mutant's change: (old line, new line), from `mutmut show`."""
    res = subprocess.run(["mutmut", "show", name], cwd=ROOT, capture_output=True, text=True, timeout=120)
    minus = [ln[1:].strip() for ln in res.stdout.splitlines() if ln.startswith("-") and not ln.startswith("---")]
    plus = [ln[1:].strip() for ln in res.stdout.splitlines() if ln.startswith("+") and not ln.startswith("+++")]
    return " ".join(minus), " ".join(plus)


TOKEN = re.compile(r"\w+|\S")


def _rounding_only(old: str, new: str) -> bool:
    """The change is only the digits argument of a round(..., N) call (changed or dropped)."""
    a, b = TOKEN.findall(old), TOKEN.findall(new)
    ops = [op for op in difflib.SequenceMatcher(a=a, b=b, autojunk=False).get_opcodes() if op[0] != "equal"]
    if len(ops) != 1 or "round" not in a:
        return False
    tag, i1, i2, j1, j2 = ops[0]
    changed = a[i1:i2] + b[j1:j2]
    return all(t.isdigit() for t in changed) and a[i1 - 1] == "," and (a[i2:i2 + 1] == [")"])


EQUIVALENT = {
    # mutant -> (a piece of the line it changes, why the change cannot alter any output); read in the
    # code. Mutant names follow the code: a name whose line no longer matches is reported as a gap.
    "diagnose.analyzers.common.x__clipped_to_step__mutmut_29": (
        "end = hi[np.clip(k, 0, None)]", "an op before the first step (k = -1) is outside whatever end it reads: "
        "`inside` also asks k >= 0"),
    "diagnose.analyzers.why_late.x_why_late__mutmut_72": (
        'ops = ""', "its one caller reads the ops only as `if ops:`, where None and \"\" are both false"),
    "diagnose.analyzers.reduce_dtype.x_reduce__mutmut_65": (
        "e[1] += 0.0 if np.isnan(b) else float(b)", "an unrecorded size read as 1 byte, not 0: all sizes "
        "unrecorded, the shares are the counts' either way; among recorded ones, 1 byte moves no figure"),
    "diagnose.analyzers.common.x_self_times__mutmut_30": (
        "if hi > start:", "at hi == start the parent loses 0 us and start stays hi: no change"),
    "diagnose.analyzers.x_reduce_rank__mutmut_15": (
        "idle_gaps=gaps", "the reducer builds the same idle model itself when not handed one (slower only)"),
    "diagnose.analyzers.x_reduce_rank__mutmut_12": (
        "idle_gaps=gaps", "idle_gaps=None: the reducer builds the same idle model itself (slower only)"),
    "diagnose.analyzers.checkpoint.x_reduce__mutmut_11": (
        "TraceMarks(count=0", "count None or 0: the one reader tests its truth only"),
    "diagnose.analyzers.straggler.x_analyze__mutmut_14": (
        "by_effect = None", "None or \"\": the one reader tests its truth only"),
    "diagnose.analyzers.host_sync.x_reduce__mutmut_71": (
        "dtype=float", "the values are floats already (a float series reindexed with a float fill)"),
    "diagnose.analyzers.common.x_host_self_times__mutmut_33": (
        "ascending=[True, True, False]", "threads in the other order: each thread's rows stay together and in "
        "time order, which is all the stack walk needs, and every reader groups or sums by name"),
    "diagnose.analyzers.memory.x__dp_size__mutmut_11": (
        'model.get("wrapper", "")', "a missing wrapper reads \"None\" instead of \"\": neither is DistributedDataParallel"),
    "diagnose.analyzers.straggler.x_analyze__mutmut_176": (
        'metrics.get("every_step_collectives", 0)', "the key is set whenever every_agree is, which the test "
        "before it requires: the default is never read"),
    "diagnose.analyzers.why_late.x_reduce__mutmut_47": (
        "RankOps(ops=())", "None or (): both readers (the op diff, the top-ops table) test its truth first"),
    "diagnose.analyzers.checkpoint.x_analyze__mutmut_17": (
        "default=0", "reached only when ctx.probes is not empty: max() never sees an empty sequence"),
    "diagnose.analyzers.checkpoint.x_analyze__mutmut_48": (
        "else -1", "with no step recorded no save lies in 1..last for last -1 or -2 alike, and that rank's "
        "figures are 0 either way"),
    "diagnose.analyzers.host_sync.x__innermost_ops__mutmut_13": (
        'groupby("tid", observed=True)', "a thread id without ops gets an empty group: its calls read None "
        "either way"),
    "diagnose.analyzers.chance.x__betacf__mutmut_80": (
        "abs(d * c - 1.0)", "a stop test that never holds runs the converged fraction to its 300 iterations: "
        "t_sf moves by under 1e-14 (compared with the unmutated code over df 1-1000, t -3 to 20)"),
    "diagnose.analyzers.reduce_dtype.x_mismatch__mutmut_196": (
        'nbytes.get("fp32", 0.0)', "count and nbytes get the same keys and the line is reached only with "
        "count['fp32'] set: the default is never read"),
    "diagnose.analyzers.launch.x__op_overhead__mutmut_42": (
        'groupby("name", observed=True)', "observed only decides whether unseen categories get a group; "
        "transform returns one value per existing row either way"),
}


def why(old: str, new: str, name: str = "") -> str:
    """Why a survivor is kept, where the change says so; else it is a gap in the tests."""
    if name in EQUIVALENT and EQUIVALENT[name][0] in old:
        return f"equivalent: {EQUIVALENT[name][1]}"
    if _rounding_only(old, new):
        return "kept: a metric's rounding (the claims are compared at 4 significant digits, on purpose)"
    if re.search(r"\bif \(.*\) or True else|else 1\.0|else 0\.0", new) and ("else 0.0" in old or "else 1.0" in old):
        return "edge: a zero-denominator guard no recorded input reaches"
    return "gap: no test notices this change"


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """95% interval of a proportion k/n (Wilson): the score of a sample, as a range."""
    if n == 0:
        return 0.0, 1.0
    p = k / n
    mid, half = p + z * z / (2 * n), z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return (mid - half) / (1 + z * z / n), (mid + half) / (1 + z * z / n)


def report(by_file: dict[str, dict[str, int | None]], show: bool) -> str:
    rows, survivors, totals = [], defaultdict(list), Counter()
    sample = json.loads(SAMPLE_FILE.read_text()) if SAMPLE_FILE.exists() else None
    if sample is not None:  # only the sampled mutants count (the first one run may not be among them)
        keep = set(sample["mutants"])
        by_file = {f: {k: v for k, v in codes.items() if k in keep} for f, codes in by_file.items()}
    for f, codes in by_file.items():
        c = Counter("killed" if v in KILLED else "survived" if v in SURVIVED else "no tests" if v in NO_TESTS
                    else "not checked" if v is None else "other" for v in codes.values())
        judged = c["killed"] + c["survived"] + c["no tests"]
        totals.update(c)
        rows.append((f, c, c["killed"] / judged if judged else None))
        survivors[f] = sorted(k for k, v in codes.items() if v in SURVIVED or v in NO_TESTS)
    judged = totals["killed"] + totals["survived"] + totals["no tests"]
    score = totals["killed"] / judged if judged else 0.0
    lo, hi = wilson(totals["killed"], judged)
    how = (f"a random sample of {len(sample['mutants'])} of the {sample['of']} mutants (seed {sample['seed']}; "
           f"95% interval of the whole score: {lo:.1%} to {hi:.1%})" if sample else "every mutant")
    if sample and sample.get("tested"):
        how += f", code and tests of {sample['tested']}"
    lines = ["# Mutation score of the checklist (`diagnose/analyzers/`)", "",
             f"`python benchmarks/mutation.py` (mutmut {MUTMUT}, the fast tests in pyproject.toml's "
             f"[tool.mutmut]), on {how}. Score = killed / (killed + survived + no test reaches it); a "
             "timeout counts as killed.", "",
             f"**Score: {score:.1%}** ({totals['killed']} killed, {totals['survived']} survived, "
             f"{totals['no tests']} reached by no test, {totals['not checked']} not run)", "",
             "| file | killed | survived | no test | score |", "|---|---|---|---|---|"]
    for f, c, s in rows:
        lines.append(f"| {f} | {c['killed']} | {c['survived']} | {c['no tests']} | "
                     f"{'-' if s is None else format(s, '.1%')} |")
    if show:
        lines += ["", "## Surviving mutants", "",
                  "Each is marked: **equivalent** (read in the code: the change cannot alter any output), "
                  "**kept** (a metric's rounding: the golden claims compare at 4 significant digits on "
                  "purpose), **edge** (a zero-denominator guard no recorded input reaches) or **gap** (no test "
                  "notices the change: a test to write).", ""]
        for f, names in survivors.items():
            if names:
                lines += [f"### {f}", ""]
                for n in names:
                    a, b = change(n)
                    lines.append(f"- `{n.rsplit('.', 1)[-1]}` ({why(a, b, n)}): `{a[:140]}` -> `{b[:140]}`")
                lines.append("")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--report", action="store_true", help="report the last run only")
    ap.add_argument("--children", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--no-show", action="store_true", help="skip listing each survivor's change (slow)")
    ap.add_argument("--sample", type=int, default=400,
                    help="mutants to run, drawn at random (0: all of them, about 8 hours on 2 cores)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--only", nargs="+", metavar="MUTANT", help="run these mutants only and print their results")
    a = ap.parse_args()
    if a.only:
        run_only(a.children, a.only)
        return
    if not a.report:
        run(a.children, a.sample, a.seed)
    text = report(results(), show=not a.no_show)
    print(text.split("## Surviving")[0])
    (ROOT / "docs" / "mutation.md").write_text(text, encoding="utf-8")
    print(f"wrote {ROOT / 'docs' / 'mutation.md'}")


if __name__ == "__main__":
    main()
