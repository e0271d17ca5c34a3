"""The core model of a training step, shared by every check and command.

- `intervals`: vectorised interval arithmetic (unions, intersections, coverage per window).
- `timeline`: one rank's lanes (compute, communication, DataLoader wait) and its steps.
- `cover`: what the analysis reads of a rank's lanes, sized by its steps, collectives and stretches
  of exposed communication, not by its kernels: built where the trace is read; the lanes stay there.
- `collectives`: collectives matched across ranks: arrival, lateness, the wait each rank imposes.
- `breakdown`: each rank's step split into disjoint components that sum to the step.
- `idle`: why a GPU idles: every idle gap attributed to one cause from its launch link.
- `pauses`: Python's garbage collections the probes placed in the profiled steps, on the trace's
  clock: time a CPU rank stood still, a part of the graph's lanes of its own.
- `graph`: every rank's steps as one dependency graph; its replay is where each finding's ms come
  from (`diagnose/whatif.py` edits it), held on disk between replays (`GraphOnDisk`);
  `parts`, its lane edges' composition, held by column.
- `bandwidth`: communication by process group and collective kind: exposed time, size, bus bandwidth.
- `link`: each group's bus bandwidth judged against the link the user names (`--link-gbps`).
- `appended`: a run-wide column grown rank after rank in one buffer (the run's collectives, the
  breakdown), not every rank's arrays held until joined.
- `changes`: the run over time: change points in every rank's step components, from the probes'
  every-step record (no trace needed), read together as events (when, where, what moved).
- `window`: the profiled window set against the rest of the run from the same record: whether the
  steps every check reads are the run's usual ones.

Commands (`diff`, `scaling`, `oncall`, ...) and the checklist (`analyzers/`) are built on
these; nothing here imports them.
"""
