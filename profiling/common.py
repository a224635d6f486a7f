"""Shared helpers of the kvxfer benchmarks: timing, limits, metadata, tables, JSON, plots.

Timing: CUDA events on GPU (one start/end pair per iteration, read after one synchronize),
``time.perf_counter`` on CPU; the reported time is the median of ``iters`` runs after
``warmup`` runs. Bandwidth is always shown next to a limit measured in the same run
(:func:`measure_limit`: a plain ``copy_`` of the same number of bytes).

Profiling hooks: :func:`nvtx_range` names what the timeline shows; with the environment
variable ``KVXFER_PROFILE_RANGE=ops`` :func:`profiled` brackets each timed loop with
``cudaProfilerStart/Stop`` (for ``ncu --profile-from-start off``), with ``=sweep`` the
benchmark brackets its whole sweep (for ``nsys --capture-range=cudaProfilerApi``).
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_OUT = os.path.join(ROOT, "profiling", "out")
PROFILE_RANGE = os.environ.get("KVXFER_PROFILE_RANGE", "")  # "", "ops" or "sweep"


# ------------------------------------------------------------------------ helper processes
def expect(conn, kind: str, proc, timeout_s: float) -> tuple:
    """The next message from a helper process over the pipe ``conn``, which must be ``(kind,
    ...)``: ``TimeoutError`` after ``timeout_s`` (saying whether ``proc`` is alive),
    ``RuntimeError`` with the helper's traceback when it sent ``("error", text)``."""
    if not conn.poll(max(0.0, timeout_s)):
        raise TimeoutError(
            f"no {kind!r} from the helper process within {timeout_s:.0f}s (alive: {proc.is_alive()})"
        )
    msg = conn.recv()
    if msg[0] == "error":
        raise RuntimeError(f"the helper process failed: {msg[1]}")
    assert msg[0] == kind, msg
    return msg


# ------------------------------------------------------------------------- the machine now
def idle_reference_us(idle_s: float = 0.01, runs: int = 30) -> tuple[float, float]:
    """(back to back, after ``idle_s`` of sleep): medians in us of one run of a fixed Python loop
    (``sum(range(100))``). The second is what a pause costs this machine's caches: on the
    2-core dev VM a step that runs after 10 ms idle costs several times what it costs back to
    back (the loop ~10x), so a benchmark whose steps come after pauses (one request at a time,
    a server between steps) prints it beside its figures."""
    out = []
    for pause in (0.0, idle_s):
        ts = []
        for _ in range(runs):
            if pause:
                time.sleep(pause)
            t0 = time.perf_counter()
            sum(range(100))
            ts.append(time.perf_counter() - t0)
        out.append(statistics.median(ts) * 1e6)
    return out[0], out[1]


# ----------------------------------------------------------------------------- devices
def pick_device(name: str | None = None) -> torch.device:
    """``name`` if given, else CUDA when present, else CPU."""
    if name:
        return torch.device(name)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ----------------------------------------------------------------------------- profiling hooks
try:  # the nvtx package works without a GPU (no-op unless a profiler is attached)
    import nvtx as _nvtx
except ImportError:  # pragma: no cover - nvtx is in the test extra
    _nvtx = None


@contextlib.contextmanager
def nvtx_range(name: str) -> Iterator[None]:
    """An NVTX push/pop range named ``name`` (no-op without the nvtx package)."""
    if _nvtx is None:
        yield
        return
    with _nvtx.annotate(name):
        yield


@contextlib.contextmanager
def profiled(device: torch.device, scope: str) -> Iterator[None]:
    """``cudaProfilerStart/Stop`` around the block when ``KVXFER_PROFILE_RANGE == scope``."""
    active = device.type == "cuda" and scope == PROFILE_RANGE
    if active:
        torch.cuda.synchronize(device)
        torch.cuda.profiler.start()
    try:
        yield
    finally:
        if active:
            torch.cuda.synchronize(device)
            torch.cuda.profiler.stop()


# ----------------------------------------------------------------------------- timing
def time_fns(
    fns: Sequence[Callable[[], Any]],
    device: torch.device,
    iters: int,
    warmup: int,
    before: Callable[[], Any] | None = None,
    names: Sequence[str] | None = None,
    hide_host: bool = False,
    host_out: list[float] | None = None,
) -> list[float]:
    """Median seconds of each of ``fns`` over ``iters`` rounds after ``warmup`` rounds.

    The functions run interleaved (round i runs fns[0], fns[1], ... once each), so an op and
    its limit see the same machine state: noise from other processes, clocks, thermals.
    ``before`` (e.g. an L2 flush) runs before every timed call, outside the timed region.
    On CUDA each call is bracketed by events on the current stream: the time is what the
    stream spends from the call's first enqueue to its last, host-side work included when the
    GPU waits for it. With ``hide_host`` a spin kernel longer than the call's host work is
    enqueued before the start event, so the call is fully enqueued before the GPU reaches it
    and the time is the GPU's alone (the kernels' bandwidth); the host work is measured apart.
    On CPU it is ``time.perf_counter`` around the call. ``host_out`` (if given) receives the
    median host seconds of each call (``perf_counter`` around it). ``names`` label each timed
    call with an NVTX range (outside the timed region).
    """
    names = list(names) if names is not None else [f"fn{i}" for i in range(len(fns))]
    if iters < 1:
        raise ValueError(f"iters: must be >= 1, got {iters}")
    warm_host: list[float] = [0.0 for _ in fns]
    for _ in range(warmup):
        for i, fn in enumerate(fns):
            t0 = time.perf_counter()
            fn()
            warm_host[i] = max(warm_host[i], time.perf_counter() - t0)
    synchronize(device)
    times: list[list[float]] = [[] for _ in fns]
    host: list[list[float]] = [[] for _ in fns]
    if device.type == "cuda":
        pairs: list[list[tuple]] = [[] for _ in fns]
        # Spin cycles covering 3x the slowest warm-up call's host time (>= 200 us), counted at
        # 2 GHz (above the boost clock of current GPUs, so the spin lasts at least that long).
        spin = [int(2e9 * max(3 * h, 200e-6)) for h in warm_host]
        with profiled(device, "ops"):
            for _ in range(iters):
                for i, (fn, p, name) in enumerate(zip(fns, pairs, names)):
                    if before is not None:
                        before()
                    start = torch.cuda.Event(enable_timing=True)
                    end = torch.cuda.Event(enable_timing=True)
                    if hide_host:
                        torch.cuda._sleep(spin[i])
                    with nvtx_range(name):
                        start.record()
                        t0 = time.perf_counter()
                        fn()
                        host[i].append(time.perf_counter() - t0)
                        end.record()
                    p.append((start, end))
            torch.cuda.synchronize(device)
        times = [[s.elapsed_time(e) / 1e3 for s, e in p] for p in pairs]
    else:
        for _ in range(iters):
            for fn, t, name in zip(fns, times, names):
                if before is not None:
                    before()
                with nvtx_range(name):
                    t0 = time.perf_counter()
                    fn()
                    t.append(time.perf_counter() - t0)
        host = times
    if host_out is not None:
        host_out[:] = [statistics.median(h) for h in host]
    return [statistics.median(t) for t in times]


def time_fn(fn: Callable[[], Any], device: torch.device, iters: int, warmup: int, before=None) -> float:
    """Median seconds of ``fn()`` (see :func:`time_fns`)."""
    return time_fns([fn], device, iters, warmup, before)[0]


def l2_flusher(device: torch.device, megabytes: int) -> Callable[[], None] | None:
    """A callable that overwrites ``megabytes`` MiB of device memory (evicts L2), or None."""
    if device.type != "cuda" or megabytes <= 0:
        return None
    buf = torch.empty(megabytes << 20, dtype=torch.uint8, device=device)
    return lambda: buf.zero_()


LIMIT_KINDS = {
    "d2d": "device copy_ (device -> device)",
    "d2h": "copy_ device -> pinned host",
    "h2d": "copy_ pinned host -> device",
    "cpu": "host copy_ (CPU -> CPU)",
}


class CopyLimit:
    """Plain ``copy_`` of N bytes: the limit a kvxfer op is compared with, in the same run.

    Buffers are kept per kind (see :data:`LIMIT_KINDS`) and grown on demand, so pinned host
    memory is not re-allocated for every row.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._bufs: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def _alloc(self, where: str, nbytes: int) -> torch.Tensor:
        if where == "dev":
            t = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        else:
            t = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.device.type == "cuda")
        return t.fill_(1)  # touch every page now, not inside a timed copy

    def fn(self, nbytes: int, kind: str) -> Callable[[], Any]:
        """A callable copying ``nbytes`` bytes of kind ``kind``."""
        if kind not in LIMIT_KINDS:
            raise ValueError(f"kind: must be one of {sorted(LIMIT_KINDS)}, got {kind!r}")
        if kind not in self._bufs or self._bufs[kind][0].numel() < nbytes:
            self._bufs.pop(kind, None)
            src_where, dst_where = {
                "d2d": ("dev", "dev"),
                "d2h": ("dev", "host"),
                "h2d": ("host", "dev"),
                "cpu": ("host", "host"),
            }[kind]
            self._bufs[kind] = (self._alloc(src_where, nbytes), self._alloc(dst_where, nbytes))
        src, dst = (b[:nbytes] for b in self._bufs[kind])
        return lambda: dst.copy_(src, non_blocking=True)

    def measure(self, nbytes: int, kind: str, iters: int, warmup: int, before=None) -> float:
        """Median seconds of the copy alone."""
        with nvtx_range(f"limit:{kind}:{nbytes}B"):
            return time_fn(self.fn(nbytes, kind), self.device, iters, warmup, before)


# ----------------------------------------------------------------------------- metadata
def gloo_loopback_s(nbytes: int, iters: int) -> float:
    """Best seconds of a raw Gloo send of ``nbytes`` between two pair groups of this process
    (loopback, one thread per rank, as two engines of one process pair): the pg link's limit
    (``bench_engine.py``; ``bench_transfer.py`` measures it between its two processes)."""
    import threading

    from kvxfer.transports.pg import groups as pg

    store = pg.serve_store("127.0.0.1", 60.0)
    key = f"bench-link-{time.monotonic_ns()}"
    groups: list = [None, None]

    def join(rank: int) -> None:
        groups[rank] = pg.new_pair(
            pg.connect_store("127.0.0.1", store.port, 60.0), key, rank, "127.0.0.1", 60.0
        )

    threads = [threading.Thread(target=join, args=(r,), daemon=True) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60.0)
    if any(g is None for g in groups):
        raise RuntimeError("gloo_loopback_s: the Gloo link pair did not form within 60 s")
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.zeros(nbytes, dtype=torch.uint8)
    times = []
    for _ in range(iters + 1):  # the first round is a warm-up
        t0 = time.perf_counter()
        sent = groups[0].send([src], 1, 0)
        pg.recv_tensor(groups[1], dst, 0, 60.0)
        sent.wait()
        times.append(time.perf_counter() - t0)
    if not torch.equal(src, dst):
        raise RuntimeError("gloo_loopback_s: the Gloo link moved wrong bytes")
    for g in groups:
        pg.discard_pair(g, "benchmark done")
    return min(times[1:])


def _version(dist: str) -> str | None:
    try:
        from importlib.metadata import version

        return version(dist)
    except Exception:
        return None


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _driver() -> str | None:
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            v = pynvml.nvmlSystemGetDriverVersion()
            return v.decode() if isinstance(v, bytes) else v
        finally:
            pynvml.nvmlShutdown()
    except Exception:
        return None


def _git_commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5
        )
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def run_metadata(device: torch.device) -> dict:
    """Device name, library versions, date and command line of this run."""
    import kvxfer

    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        name = props.name
        extra = {"sm": f"{props.major}.{props.minor}", "gpu_mem_gib": round(props.total_memory / 2**30, 1)}
    else:
        name, extra = _cpu_model(), {"threads": torch.get_num_threads()}
    return {
        "device": name,
        "device_type": device.type,
        **extra,
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "command": shlex.join([os.path.basename(sys.executable), *sys.argv]),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": _version("triton"),
        "cuda": torch.version.cuda,
        "driver": _driver() if device.type == "cuda" else None,
        "kvxfer": kvxfer.__version__,
        "git_commit": _git_commit(),
        "host": platform.node(),
        "loadavg_1m": round(os.getloadavg()[0], 2),  # other work on the machine skews CPU timings
    }


def write_json(path: str, meta: dict, rows: Sequence[dict], **extra) -> None:
    """``{"meta": ..., "rows": [...]}``; every row also carries the device name and date."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tagged = [{"device": meta["device"], "date": meta["date"], **r} for r in rows]
    with open(path, "w") as f:
        json.dump({"meta": meta, **extra, "rows": tagged}, f, indent=1)
        f.write("\n")


# ----------------------------------------------------------------------------- tables
@dataclass(frozen=True)
class Column:
    """One table column: row key, header, width and a format for the value."""

    key: str
    header: str
    width: int
    fmt: str = "{}"

    def cell(self, row: dict) -> str:
        v = row.get(self.key)
        if v is None:
            return "-".rjust(self.width)
        return self.fmt.format(v).rjust(self.width)


class Table:
    """nccl-tests-style table: ``#`` header lines, right-aligned rows, streamed as they come."""

    def __init__(self, columns: Sequence[Column], write: Callable[[str], None] = print) -> None:
        self.columns = list(columns)
        self.write = write

    def header(self, title_lines: Iterable[str] = ()) -> None:
        for line in title_lines:
            self.write(f"# {line}")
        self.write("#")
        self.write("#" + " ".join(c.header.rjust(c.width) for c in self.columns)[1:])

    def row(self, row: dict) -> None:
        self.write(" " + " ".join(c.cell(row) for c in self.columns)[1:])


def progress(items: Sequence, desc: str):
    """tqdm over ``items`` on stderr (hidden when stderr is not a terminal).

    tqdm is optional (``pip install kvxfer[profile]``): without it the items come back as they
    are and one note on stderr says there is no progress bar.
    """
    try:
        from tqdm import tqdm
    except ImportError:
        print(f"note: tqdm not installed: no progress bar for {desc} (pip install tqdm)", file=sys.stderr)
        return items
    return tqdm(items, desc=desc, file=sys.stderr, disable=None, dynamic_ncols=True, leave=False)


def table_writer() -> Callable[[str], None]:
    """``print`` that does not break a running tqdm bar (plain ``print`` without tqdm)."""
    try:
        from tqdm import tqdm

        return lambda s: tqdm.write(s, file=sys.stdout)
    except ImportError:
        return print


# ----------------------------------------------------------------------------- plots
def plot_bandwidth(
    rows: Sequence[dict],
    path: str,
    title: str,
    panel: Callable[[dict], str],
    label: Callable[[dict], str],
    write: Callable[[str], None] = print,
) -> bool:
    """PNG of GB/s (top) and % of limit (bottom) vs bytes; one panel column per ``panel(row)``.

    Each line is the rows sharing ``label(row)``; dashed grey lines are the limits measured in
    the same run (``row["limit_kind"]``). Rows without a time (errors) are left out.
    matplotlib is optional (``pip install kvxfer[profile]``): without it nothing is drawn, one
    ``# note:`` line goes to ``write`` and the result is False (True when the PNG was written).
    """
    try:
        import matplotlib
    except ImportError:
        write(
            f"# note: matplotlib not installed: {os.path.basename(path)} not drawn (pip install matplotlib)"
        )
        return False

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if r.get("gbps")]
    panels = sorted({panel(r) for r in rows}) or ["(no rows)"]
    fig, axes = plt.subplots(2, len(panels), figsize=(6 * len(panels), 8), squeeze=False, sharex=True)
    for col, name_ in enumerate(panels):
        sel = [r for r in rows if panel(r) == name_]
        top, bottom = axes[0][col], axes[1][col]
        for name in sorted({label(r) for r in sel}):
            pts = sorted((r["bytes"], r["gbps"], r["pct_limit"]) for r in sel if label(r) == name)
            xs = [p[0] for p in pts]
            top.plot(xs, [p[1] for p in pts], marker="o", ms=3, label=name)
            bottom.plot(xs, [p[2] for p in pts], marker="o", ms=3)
        for kind in sorted({r["limit_kind"] for r in sel}):
            pts = sorted({(r["bytes"], r["limit_gbps"]) for r in sel if r["limit_kind"] == kind})
            top.plot(
                [p[0] for p in pts], [p[1] for p in pts], "x:", color="grey", lw=0.8, label=f"limit {kind}"
            )
        top.set_title(name_)
        top.set_ylabel("GB/s")
        bottom.set_ylabel("% of limit (same run)")
        bottom.set_xlabel("bytes moved")
        bottom.axhline(90, color="green", lw=0.8, ls=":")
        for ax in (top, bottom):
            ax.set_xscale("log", base=2)
            ax.grid(True, which="both", alpha=0.3)
        if top.get_legend_handles_labels()[0]:
            top.legend(fontsize=6, loc="best")
        else:
            top.text(0.5, 0.5, "no timed rows", ha="center", transform=top.transAxes)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
