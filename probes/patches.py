"""Hooks that feed a Probe from an unmodified training script.

- DataLoader.__iter__: the returned iterator is wrapped so each `next()` is timed
  (time blocked waiting for a batch).
- Optimizer step post-hook (torch's global hook): the step boundary.
- torch.distributed collectives: wrapped to record arrival, duration, bytes, group.
- DistributedDataParallel: a timing comm hook around the default all-reduce, registered
  lazily at the first forward so a user's own `register_comm_hook` call still works
  (theirs is wrapped with the same timing instead).
- torch's profiler, whoever starts it: a profiler the job starts itself makes the probe's stand
  aside (torch runs one at a time; `Probe.on_job_profiler`).

Every wrapper calls the original first-class function and swallows only its own errors.
"""
from __future__ import annotations

import functools
import threading
import time

from .core import Probe

COLLECTIVES = ("all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter",
               "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "reduce", "gather", "scatter",
               "barrier", "send", "recv", "_all_gather_base", "_reduce_scatter_base",
               "all_gather_single", "reduce_scatter_single")  # the last two: what FSDP2 calls (torch 2.13)
_MARK = "__diagnose_probe__"
# Set while a DDP comm hook runs: the all-reduce it issues is the bucket's, timed once.
_inside_hook = threading.local()


def _nbytes(obj) -> int:
    import torch

    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, (list, tuple)):
        return sum(_nbytes(x) for x in obj[:1024])
    return 0


def _group_name(kwargs) -> str:
    g = kwargs.get("group")
    if g is None:
        return "default"
    try:
        import torch.distributed as dist

        return str(dist.distributed_c10d._get_process_group_name(g))
    except Exception:  # noqa: BLE001
        return "group"


EVAL_BATCH = "diagnose: evaluation batch"
"""The probes' trace annotation around each fetch of an evaluation's DataLoader inside the training
steps: one iterated with autograd off, or by a Trainer's evaluation loop (Hugging Face fetches its
evaluation batches with autograd on). The dataloader check tells that wait from the training
batches' (both are time the step loses, and their fixes are different loaders)."""
NO_GRAD_BATCH = "diagnose: batch fetched with autograd off"
"""The same annotation as the probes named it until 2026-12-07 (recorded traces hold it)."""
EVAL_BATCH_NAMES = (EVAL_BATCH, NO_GRAD_BATCH)
EVAL_LOOPS = frozenset({"evaluation_loop", "prediction_loop"})
"""Hugging Face Trainer's loops over an evaluation DataLoader (transformers.trainer)."""


def _in_trainer_evaluation(depth: int = 16) -> bool:
    """Called (a few frames up) from a Hugging Face Trainer's evaluation loop: it iterates its
    evaluation DataLoader with autograd on (its torch.no_grad() is inside prediction_step)."""
    import sys

    f = sys._getframe(2)
    for _ in range(depth):
        if f is None:
            return False
        if f.f_code.co_name in EVAL_LOOPS and str(f.f_globals.get("__name__", "")).startswith("transformers."):
            return True
        f = f.f_back
    return False


def timed_loader(probe: Probe, loader, it):
    """`it`, loader's iterator, timed; the loader's settings recorded as the training loader's,
    or, an evaluation's (iterated with autograd off, or by a Trainer's evaluation loop), as
    `dataloader_no_grad`, its fetches marked EVAL_BATCH."""
    import torch

    from .meta import loader_facts

    if torch.is_grad_enabled() and not _in_trainer_evaluation():
        probe.meta.setdefault("dataloader", {}).update(loader_facts(loader))
        return _TimedIter(it, probe)
    probe.meta.setdefault("dataloader_no_grad", {}).update(loader_facts(loader))
    return _TimedIter(it, probe, mark=EVAL_BATCH)


class _TimedIter:
    """Iterator proxy timing each next(); everything else passes through. With `mark`, each next()
    runs inside a profiler annotation of that name (nothing is recorded while no profiler runs)."""

    def __init__(self, it, probe: Probe, mark: str | None = None) -> None:
        self._it = it
        self._probe = probe
        self._mark = mark
        # a training iterator's first fetch: an epoch's start, where the workers' prefetch begins
        # from nothing (persistent workers or not): the analysis tells that wait from the rest
        self._first = mark is None
        if mark is not None:
            from torch.autograd.profiler import record_function

            self._span = record_function

    def __iter__(self):
        return self

    def __next__(self):
        t = time.perf_counter()
        gc0 = self._probe.gc_clock_ms
        self._probe.fetching += 1
        span = None
        if self._mark is not None:
            try:
                span = self._span(self._mark)
                span.__enter__()
            except Exception:  # noqa: BLE001 - a probe must never raise into training
                span = None
        try:
            return next(self._it)
        finally:
            if span is not None:
                try:
                    span.__exit__(None, None, None)
                except Exception:  # noqa: BLE001, S110
                    pass
            first, self._first = self._first, False
            self._probe.fetching -= 1
            self._probe.on_data_wait(time.perf_counter() - t, first, self._probe.gc_clock_ms - gc0)

    def __len__(self):
        return len(self._it)

    def __getattr__(self, name):
        return getattr(self._it, name)


def install(probe: Probe) -> list:
    """Install all hooks; returns undo callables. Each part fails on its own."""
    undo: list = []
    for part in (_job_profiler, _dataloader, _optimizer, _collectives, _ddp, _memory, _checkpoint, _gc):
        try:
            u = part(probe)
            if u:
                undo.append(u)
        except Exception as exc:  # noqa: BLE001
            probe._fail(f"hook {part.__name__.strip('_')}", exc)
    return undo


def _job_profiler(probe: Probe):
    """Tell the probe when a profiler it does not drive starts, prepares or is enabled.

    `torch.profiler.profile.start` (and `with profile(...)`): from then on its ProfilerStep#N
    markers go into any recording profiler, the probe's included, even while its own schedule
    waits. Every torch profiler then goes through `torch.autograd.profiler.profile._prepare_trace`
    before it records (torch.profiler.profile, the legacy context manager; Lightning's
    PyTorchProfiler and accelerate's Accelerator.profile() are these) and through
    `_run_on_profiler_start` as it is enabled (those two, plus emit_nvtx and emit_itt): private
    names of torch 2.x, each patched where it exists.
    """
    import torch.profiler as tp
    from torch.autograd import profiler as ap

    def first(action):
        """orig, with `action` run before it when the call is not one of the probe's own."""
        def wrap(orig):
            @functools.wraps(orig)
            def wrapper(*args, **kwargs):
                if not probe.in_own_profiler_call():
                    try:
                        action()
                    except Exception as exc:  # noqa: BLE001
                        probe._fail("job profiler", exc)
                return orig(*args, **kwargs)

            setattr(wrapper, _MARK, True)
            return wrapper

        return wrap

    def noted(orig):
        """export_chrome_trace, its path told to the probe once written (not for the probe's own)."""
        @functools.wraps(orig)
        def wrapper(self, path, *args, **kwargs):
            out = orig(self, path, *args, **kwargs)
            if not probe.in_own_profiler_call():
                try:
                    probe.on_job_trace(path)
                except Exception as exc:  # noqa: BLE001
                    probe._fail("job profiler", exc)
            return out

        setattr(wrapper, _MARK, True)
        return wrapper

    warned, settled = first(probe.on_job_profiler), first(probe.settle_works)
    undo = []
    for owner, name, wrap in (
            # where the job's own profiler writes (tensorboard_trace_handler, torchtitan, Lightning
            # export through it): `diagnose run` analyses those files when the probes' profiler stood aside
            (tp.profile, "export_chrome_trace", noted),
            (tp.profile, "start", warned),
            (ap.profile, "_prepare_trace", warned),
            # the job's profiler stops (stop_trace, the end of a `with`): its CPU collectives settled
            # first, as for the probe's own (inflight.py: gloo ends their events after waking the thread)
            (ap.profile, "__exit__", settled),
            (ap, "_run_on_profiler_start", warned)):  # a module global, looked up at each call
        orig = getattr(owner, name, None)
        if orig is not None and not getattr(orig, _MARK, False):
            setattr(owner, name, wrap(orig))
            undo.append(functools.partial(setattr, owner, name, orig))
    return (lambda: [u() for u in undo]) if undo else None


def _dataloader(probe: Probe):
    from torch.utils.data import DataLoader

    orig = DataLoader.__iter__
    if getattr(orig, _MARK, False):
        return None

    @functools.wraps(orig)
    def __iter__(self):
        it = orig(self)
        try:
            return timed_loader(probe, self, it)
        except Exception as exc:  # noqa: BLE001
            probe._fail("dataloader timing", exc)
            return it

    setattr(__iter__, _MARK, True)
    DataLoader.__iter__ = __iter__
    return lambda: setattr(DataLoader, "__iter__", orig)


def _optimizer(probe: Probe):
    from torch.optim.optimizer import register_optimizer_step_post_hook

    from .memory_hook import MAX_OPTIMIZERS

    def hook(opt, args, kwargs):
        try:
            marks = probe.optimizers
            first = not marks.known(opt)
            n = marks.number(opt)
            if first and len(probe.meta.get("optimizers") or ()) < MAX_OPTIMIZERS:
                from .meta import optimizer_facts

                probe.meta.setdefault("optimizers", []).append({**optimizer_facts(opt), "number": n})
            ends_step, retired = marks.on_step(opt)
            if retired is not None:
                retire_optimizer(probe.meta, retired, probe.step)
            if ends_step:
                probe.start_profiler()
                probe.on_step()
        except Exception as exc:  # noqa: BLE001
            probe._fail("step hook", exc)

    handle = register_optimizer_step_post_hook(hook)
    return handle.remove


def retire_optimizer(meta: dict, number: int, step: int) -> None:
    """Mark the facts recorded of optimizer `number` as no longer the job's (probes/optimizers.py)."""
    for key in ("optimizers", "memory_tensors"):
        for facts in meta.get(key) or ():
            if isinstance(facts, dict) and facts.get("number") == number:
                facts.setdefault("retired_at_step", step)


def _collectives(probe: Probe):
    import torch.distributed as dist

    originals = {}
    for name in COLLECTIVES:
        fn = getattr(dist, name, None)
        if fn is None or getattr(fn, _MARK, False):
            continue
        originals[name] = fn
        setattr(dist, name, _timed(fn, name, probe))

    def undo():
        for n, f in originals.items():
            setattr(dist, n, f)

    return undo


def _cuda_event():
    """A timing event recorded on the current stream: no host sync, read later with query()."""
    import torch

    e = torch.cuda.Event(enable_timing=True)
    e.record()
    return e


def _is_cuda(obj) -> bool:
    first = obj[0] if isinstance(obj, (list, tuple)) and obj else obj
    return bool(getattr(first, "is_cuda", False))


def _compiling() -> bool:
    """True while torch.compile traces the caller. Each wrapper then steps aside and calls the
    original: timing code (perf_counter, a logger, a dict lookup on the module) inside a traced
    function is a graph break at best, and at worst (an error in the probe while tracing) makes
    torch.compile fall back to running the whole model eagerly: the probe would change what the
    job runs. Constant-folded by the tracer, so it costs the compiled code nothing."""
    try:
        import torch

        return bool(torch.compiler.is_compiling())
    except Exception:  # noqa: BLE001
        return False


def _timed(fn, name: str, probe: Probe):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if _compiling():
            return fn(*args, **kwargs)
        t = time.perf_counter()
        hooked = getattr(_inside_hook, "active", False)  # a DDP bucket's all-reduce is timed by its hook
        e0 = None
        if not hooked and args and not kwargs.get("async_op"):
            try:
                e0 = _cuda_event() if _is_cuda(args[0]) else None
            except Exception as exc:  # noqa: BLE001
                probe._fail("cuda timing", exc)
        result = fn(*args, **kwargs)  # the user's exceptions propagate untouched
        if kwargs.get("async_op") and result is not None:
            try:
                if args and not _is_cuda(args[0]):
                    probe.on_async_work(result)  # waited for before a profiler stops (inflight.py)
            except Exception as exc:  # noqa: BLE001
                probe._fail("collectives", exc)
        if not hooked:
            try:
                label = name if not kwargs.get("async_op") else name + "(async)"
                nbytes, group = (_nbytes(args[0]) if args else 0), _group_name(kwargs)
                if e0 is not None:
                    # NCCL returns before the transfer ends: time it on the device, read it later
                    probe.on_cuda_collective(label, t, e0, _cuda_event(), nbytes, group)
                else:
                    probe.on_collective(label, t, time.perf_counter(), nbytes, group)
            except Exception as exc:  # noqa: BLE001
                probe._fail("collectives", exc)
        return result

    setattr(wrapper, _MARK, True)
    return wrapper


def _ddp(probe: Probe):
    from torch.autograd.profiler import record_function
    from torch.nn.parallel import DistributedDataParallel as DDP

    orig_forward = DDP.forward
    orig_register = DDP.register_comm_hook
    orig_init = DDP.__init__
    if getattr(orig_forward, _MARK, False):
        return None

    def timed_hook(user_hook):
        def hook(state, bucket):
            t = time.perf_counter()
            nbytes, e0 = 0, None
            try:
                buf = bucket.buffer()
                nbytes = _nbytes(buf)
                e0 = _cuda_event() if buf.is_cuda else None
            except Exception:  # noqa: BLE001
                pass
            _inside_hook.active = True
            try:
                # named like DDP's own reducer work so the analysis counts the hook's
                # bucket division and launch as communication overhead, not model compute
                with record_function("reducer::diagnose_comm_hook"):
                    fut = user_hook(state, bucket)
            finally:
                _inside_hook.active = False

            def done(f):
                if e0 is not None:
                    # the callback's stream is ordered after the all-reduce: time it on the device
                    probe.on_cuda_collective("ddp_bucket_allreduce", t, e0, _cuda_event(), nbytes, "default")
                else:
                    probe.on_collective("ddp_bucket_allreduce", t, time.perf_counter(), nbytes, "default")
                return f.value()

            try:
                return fut.then(done)
            except Exception as exc:  # noqa: BLE001
                probe._fail("ddp timing", exc)
                return fut

        return hook

    @functools.wraps(orig_register)
    def register_comm_hook(self, state, hook):
        self.__dict__["_diagnose_user_hook"] = True
        return orig_register(self, state, timed_hook(hook))

    @functools.wraps(orig_init)
    def __init__(self, *args, **kwargs):
        orig_init(self, *args, **kwargs)
        try:  # the model's facts at construction: a compiled forward never runs our wrapper's body
            from .meta import model_facts

            probe.meta["model"] = model_facts(self)
        except Exception as exc:  # noqa: BLE001
            probe._fail("ddp timing", exc)

    @functools.wraps(orig_forward)
    def forward(self, *args, **kwargs):
        # the timing hook is registered at the first eager forward (a user's own register_comm_hook
        # comes before it); under torch.compile this body is skipped and the bucket all-reduces are
        # timed from the trace alone
        if not _compiling() and not self.__dict__.get("_diagnose_hooked"):
            self.__dict__["_diagnose_hooked"] = True
            try:
                if not self.__dict__.get("_diagnose_user_hook"):
                    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

                    orig_register(self, self.process_group, timed_hook(allreduce_hook))
            except Exception as exc:  # noqa: BLE001
                probe._fail("ddp timing", exc)
        return orig_forward(self, *args, **kwargs)

    setattr(forward, _MARK, True)
    DDP.__init__ = __init__
    DDP.forward = forward
    DDP.register_comm_hook = register_comm_hook

    def undo():
        DDP.__init__ = orig_init
        DDP.forward = orig_forward
        DDP.register_comm_hook = orig_register

    return undo


def _memory(probe: Probe):
    from . import memory_hook

    return memory_hook.install(probe)


def _gc(probe: Probe):
    """Time Python's garbage collections of generations 1 and 2 (gc.callbacks): a full pass walks
    every tracked object and stops the training thread meanwhile, at steps each rank's allocations
    decide, while the other ranks wait at the next collective. The collector's settings go in the
    metadata."""
    import gc

    started = [0.0]
    clock = time.perf_counter

    def timed(phase, info):
        # generation 0 runs every few hundred allocations and takes microseconds: left untimed, a
        # collection with this callback costs ~1.5 us (0.07 bare, ~2.4 timed; measured by
        # benchmarks/bench_probe_overhead.py: most of it is CPython calling any callback at all)
        try:
            generation = info["generation"]
            if not generation:
                return
            if phase == "start":
                started[0] = clock()
            elif started[0]:
                probe.on_gc(clock() - started[0], generation, started[0])
                started[0] = 0.0
        except Exception as exc:  # noqa: BLE001 - a probe must never raise into training
            probe._fail("gc timing", exc)

    if any(getattr(cb, _MARK, False) for cb in gc.callbacks):
        return None
    setattr(timed, _MARK, True)
    # placed: each long pass's place in its step is recorded (StepRecord.gc_passes)
    probe.meta["gc"] = {"timed": True, "placed": True, "enabled": gc.isenabled(), "threshold": list(gc.get_threshold()),
                        "frozen": gc.get_freeze_count()}
    gc.callbacks.append(timed)

    def undo():
        if timed in gc.callbacks:
            gc.callbacks.remove(timed)

    return undo


def _checkpoint(probe: Probe):
    from . import checkpoint_hook

    return checkpoint_hook.install(probe)
