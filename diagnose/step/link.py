"""Communication against the link: does a group's bus bandwidth reach what its link can carry?

The bandwidth table (step/bandwidth.py) says how fast each group's collectives moved; whether
that is good depends on the link under the group, which a trace does not record. So:
- **Hosts**: each rank's host comes from the probes' sidecars (`host`, the machine's node name);
  a group spans hosts when its ranks (the trace's pg_config, else every rank loaded) sit on more
  than one. Bare traces carry no host names: spanning is then unknown.
- **Link**: given by the user (`--link-gbps INTRA[,INTER]`, bus bandwidth in GB/s as nccl-tests
  reports it: measure it with nccl-tests' all_reduce_perf on the same machines). A group within
  one host is judged against INTRA, one spanning hosts against INTER; a single figure stands
  for the link whatever the hosts; with two figures and hosts unknown, no verdict (which of the
  two applies is exactly what is unknown). No link is guessed from a device name: the same GPU
  ships on NVLink boards and PCIe cards, behind one NIC or eight.
- **Verdict** (bandwidth-bound groups only: under 1 MiB a collective's time is per-call latency,
  and a low bus bandwidth says "too many small messages", not "slow link"):
  near the link's peak (Thresholds.link_near_peak or more of it): fewer bytes is the only lever;
  far below it (under Thresholds.link_far_below): a slow or shared link, a topology that routes
  the group over the slower path, or NCCL fell back to a slower transport;
  in between: below the peak, the usual for real jobs. Where a group's transfers could only be
  timed from the rank's own arrival (one rank loaded: the time holds the wait for peers), its share
  is a lower bound: "near peak" still stands, anything less is "lower bound".
- **Tensor-parallel-sized groups that span hosts**: a group of at most TP_SIZED ranks, smaller
  than the world, over more than one host: tensor (or sequence) parallelism communicates inside
  every layer and belongs within one host's fast link.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from diagnose.thresholds import Thresholds

if TYPE_CHECKING:  # the CLI parses LinkSpec before any analysis is loaded: no pandas behind this module
    from diagnose.step.bandwidth import GroupComm

TP_SIZED = 8
"""The largest group taken as tensor-parallel-sized: one host's GPUs on today's 8-GPU boards."""
DECIDE = ("pass --link-gbps INTRA[,INTER] (the bus bandwidth nccl-tests' all_reduce_perf reaches on these "
          "machines) to judge it against the link; NCCL_DEBUG=INFO names the transport NCCL chose")


@dataclass(frozen=True, slots=True)
class LinkSpec:
    """The link's peak bus bandwidth, GB/s, within one host and between hosts (None: not given)."""

    intra_gbps: float | None = None
    inter_gbps: float | None = None

    def __post_init__(self) -> None:
        for v in (self.intra_gbps, self.inter_gbps):
            if v is not None and not (math.isfinite(v) and v > 0):
                raise ValueError(f"a link's bandwidth must be a positive number of GB/s, not {v}")

    @classmethod
    def parse(cls, text: str) -> LinkSpec:
        """'INTRA' or 'INTRA,INTER' (GB/s); 'INTRA,' or ',INTER' leave one out."""
        parts = [p.strip() for p in text.split(",")]
        if not 1 <= len(parts) <= 2 or not any(parts):
            raise ValueError(f"expected INTRA or INTRA,INTER in GB/s, got {text!r}")
        try:
            vals = [float(p) if p else None for p in parts]
        except ValueError:
            raise ValueError(f"expected INTRA or INTRA,INTER in GB/s, got {text!r}") from None
        return cls(intra_gbps=vals[0], inter_gbps=vals[1] if len(vals) > 1 else None)


@dataclass(frozen=True, slots=True)
class LinkView:
    """One group row judged against the link."""

    hosts: int | None
    """Hosts the group's ranks sit on (None: host names unknown)."""
    link: str | None
    """"intra-host" or "inter-host": which of the user's figures it is judged against."""
    link_gbps: float | None
    share: float | None
    """Bus bandwidth / link_gbps."""
    verdict: str
    """near peak, below peak, far below, latency-bound, no bandwidth or link unknown."""
    text: str
    """One sentence for the terminal and the report."""
    tp_spans_hosts: bool = False


def group_ranks(meta_pg: list[dict], group: str, ranks: list[int]) -> list[int]:
    """The group's ranks from the traces' pg_config (its `ranks` list), else every rank loaded."""
    for pg in meta_pg:
        if isinstance(pg, dict) and str(pg.get("pg_name")) == group and isinstance(pg.get("ranks"), list):
            members = [r for r in pg["ranks"] if isinstance(r, int)]
            if members:
                return members
    return list(ranks)


def _link_for(spans: bool | None, link: LinkSpec | None) -> tuple[str | None, float | None]:
    """(which link, its GB/s) a group is judged against; (None, None) when none applies."""
    if link is None:
        return None, None
    if link.inter_gbps is None:  # one figure: it stands for the link whatever the hosts
        return ("intra-host" if spans is False else "given"), link.intra_gbps
    if spans is None:
        return None, None
    return ("inter-host", link.inter_gbps) if spans else ("intra-host", link.intra_gbps)


def judge(g: GroupComm, members: list[int], hosts: dict[int, str], world: int, link: LinkSpec | None,
          th: Thresholds) -> LinkView:
    """g judged against the link (see the module doc). hosts: rank -> host name, where known."""
    known = [hosts[r] for r in members if r in hosts]
    n_hosts = len(set(known)) if known and len(known) == len(members) else None
    if n_hosts is None and len(set(known)) > 1:
        n_hosts = len(set(known))  # some ranks unknown, but two hosts seen already: it spans
    spans = None if n_hosts is None else n_hosts > 1
    tp = bool(spans) and g.ranks <= TP_SIZED and g.ranks < world
    tp_text = (f"; a tensor-parallel-sized group ({g.ranks} ranks) spans {n_hosts} hosts: keep it within one "
               "host's fast link (place the tensor-parallel dimension innermost)") if tp else ""
    where = "unknown hosts" if spans is None else f"{n_hosts} hosts" if spans else "one host"
    if not g.sized or g.busbw_gbps is None:
        return LinkView(n_hosts, None, None, None, "no bandwidth", "sizes not recorded: no bandwidth to judge" + tp_text,
                        tp)
    if g.regime == "latency-bound":
        return LinkView(n_hosts, None, None, None, "latency-bound",
                        f"latency-bound (median message under 1 MiB): its speed is per-call latency, not the "
                        f"link's; fewer, larger messages help{tp_text}", tp)
    kind, peak = _link_for(spans, link)
    if peak is None:
        why = DECIDE if link is None else \
            "which of the two links applies is unknown (no host names: run the job under diagnose run)" \
            if spans is None else f"--link-gbps gives no {'inter' if spans else 'intra'}-host figure"
        return LinkView(n_hosts, None, None, None, "link unknown",
                        f"{g.busbw_gbps:.2f} GB/s bus on {where}; no verdict on the link: {why}{tp_text}", tp)
    share = g.busbw_gbps / peak
    name = "the given link's" if kind == "given" else f"the {kind} link's"
    head = f"{g.busbw_gbps:.2f} GB/s bus on {where}, {share:.0%} of {name} {peak:g} GB/s"
    if share < th.link_near_peak and g.transfer != "matched across ranks":
        # timed from the rank's own arrival, the transfer holds the wait for its peers: the share is a
        # lower bound, enough to say "near peak", never "far below"
        return LinkView(n_hosts, kind, peak, share, "lower bound",
                        f"{g.busbw_gbps:.2f} GB/s bus on {where}: at least {share:.0%} of {name} {peak:g} GB/s; "
                        "its transfers are timed from this rank's own arrival and include waits for its peers "
                        f"(load every rank to judge it){tp_text}", tp)
    if share >= th.link_near_peak:
        verdict, tail = "near peak", ": near the link's peak; fewer bytes is the only lever (bf16 gradients, " \
                                     "no_sync() under accumulation, larger micro-batches)"
    elif share < th.link_far_below:
        verdict, tail = "far below", (": far below the link: a slow or shared link, a topology that sends the "
                                      "group over the slower path, or NCCL fell back to a slower transport "
                                      "(NCCL_DEBUG=INFO names the transport)")
    else:
        verdict, tail = "below peak", ": below the peak, as real jobs usually are"
    return LinkView(n_hosts, kind, peak, share, verdict, head + tail + tp_text, tp)
