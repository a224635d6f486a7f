"""Sweep the Triton kernel's GPU tile size and warp count over the rows that matter.

Each configuration runs ``bench_ops.py`` in its own process with ``$KVXFER_TRITON_TILE_BYTES``
and ``$KVXFER_TRITON_NUM_WARPS`` set (read when the kernels load), so each compiles its own
variants; the rows are verified byte for byte as always. Prints, per row, the fraction of the
in-run limit under each configuration and the best one, plus a ``#wrong`` column, and writes
``sweep_triton_tiles.json``. The defaults live in ``kvxfer/kernels/launch.py``.

    python profiling/sweep_triton_tiles.py --out OUT            # GPU: 4 tiles x 2 warp counts
    python profiling/sweep_triton_tiles.py --tiles 8192,16384 --warps 4 --models llama3-8b-1head
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from profiling import common

HERE = os.path.dirname(os.path.abspath(__file__))


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiles", default="8192,16384,32768,65536", help="comma list of tile bytes")
    p.add_argument("--warps", default="4,8", help="comma list of warps per program")
    p.add_argument("--models", default="llama3-8b,llama3-8b-1head")
    p.add_argument("--ops", default="gather,scatter,copy")
    p.add_argument("--layouts", default="NHD")
    p.add_argument("--sizes", default="4096")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--backend", default="triton", help="triton (the knobs' backend; others: plumbing only)")
    p.add_argument("--device", default=None, help="cuda / cpu (default: cuda when present)")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds per configuration")
    p.add_argument("--out", default=os.path.join(HERE, "out"))
    a = p.parse_args(argv)
    for name in ("tiles", "warps"):
        value = getattr(a, name)
        if not all(x.isdigit() and int(x) > 0 for x in value.split(",")):
            p.error(f"--{name}: {value!r} is not a comma list of positive ints")
    bad = [x for x in a.ops.split(",") if x not in ("gather", "scatter", "copy")]
    if bad:
        p.error(f"--ops: unknown {bad} (gather, scatter, copy)")
    return a


def _run_config(a: argparse.Namespace, tile: int, warps: int) -> tuple[list[dict], str]:
    """bench_ops rows of one configuration, and an error line ("" when it ran)."""
    out = os.path.join(a.out, f"tile{tile}_warps{warps}")
    env = dict(os.environ, KVXFER_TRITON_TILE_BYTES=str(tile), KVXFER_TRITON_NUM_WARPS=str(warps))
    cmd = [
        sys.executable, os.path.join(HERE, "bench_ops.py"), "--backends", a.backend,
        "--models", a.models, "--ops", a.ops, "--layouts", a.layouts, "--sizes", a.sizes,
        "--dest", "device", "--copy-to", "same", "--iters", str(a.iters), "--warmup", str(a.warmup),
        "--out", out,
    ]  # fmt: skip
    if a.device:
        cmd += ["--device", a.device]
    try:
        res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=a.timeout)
    except subprocess.TimeoutExpired:
        return [], f"timed out after {a.timeout:.0f}s"
    if res.returncode != 0:
        tail = (res.stderr or res.stdout).strip().splitlines()[-1:] or ["no output"]
        return [], f"bench_ops exited {res.returncode}: {tail[0]}"
    with open(os.path.join(out, "bench_ops.json")) as f:
        return [r for r in json.load(f)["rows"] if r["backend"] == a.backend], ""


def main(argv=None) -> int:
    a = parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    write = common.table_writer()
    configs = [(int(t), int(w)) for t in a.tiles.split(",") for w in a.warps.split(",")]
    meta = common.run_metadata(common.pick_device(a.device))
    write(f"# kvxfer sweep_triton_tiles on {meta['device']}, commit {meta.get('git_commit')}")
    write(f"# command: {' '.join([os.path.basename(sys.argv[0]), *(argv or sys.argv[1:])])}")
    write("# %limit = bench_ops' fraction of a device copy_ of the same bytes in the same run; * = default")
    results: dict[tuple[int, int], dict] = {}
    errors: dict[str, str] = {}
    for tile, warps in configs:
        t0 = time.perf_counter()
        rows, err = _run_config(a, tile, warps)
        name = f"{tile}/{warps}"
        if err:
            errors[name] = err
            write(f"# {name}: {err}")
            continue
        write(f"# {name}: {len(rows)} rows in {time.perf_counter() - t0:.0f}s")
        for r in rows:
            key = (r["model"], r["layout"], r["op"], r["tokens"])
            results.setdefault(key, {})[(tile, warps)] = r
    from kvxfer.kernels.launch import DEFAULT_NUM_WARPS, DEFAULT_TILE_BYTES  # marked * in the table

    default = (DEFAULT_TILE_BYTES, DEFAULT_NUM_WARPS)
    names = [f"{t}/{w}" + ("*" if (t, w) == default else "") for t, w in configs]
    write(f"#{'model':>15} {'op':>7} {'layout':>6} {'tokens':>6} " + " ".join(f"{n:>10}" for n in names)
          + f" {'best':>10} {'#wrong':>6}")  # fmt: skip
    summary, wrong_total = [], 0
    for key, per in sorted(results.items()):
        cells, best, wrong = [], None, 0
        for cfg in configs:
            r = per.get(cfg)
            cells.append(f"{r['pct_limit']:10.1f}" if r else f"{'-':>10}")
            if r:
                wrong += r["wrong"]
                if best is None or r["pct_limit"] > per[best]["pct_limit"]:
                    best = cfg
        wrong_total += wrong
        best_name = f"{best[0]}/{best[1]}" if best else "-"
        write(
            f" {key[0]:>15} {key[2]:>7} {key[1]:>6} {key[3]:>6} "
            + " ".join(cells)
            + f" {best_name:>10} {wrong:>6}"
        )
        summary.append(
            {
                "model": key[0], "layout": key[1], "op": key[2], "tokens": key[3], "best": best_name,
                "pct_limit": {f"{c[0]}/{c[1]}": per[c]["pct_limit"] for c in configs if c in per},
                "wrong": wrong,
            }
        )  # fmt: skip
    path = os.path.join(a.out, "sweep_triton_tiles.json")
    with open(path, "w") as f:
        json.dump({"meta": meta, "configs": names, "rows": summary, "errors": errors}, f, indent=1)
    write(f"# wrong: {wrong_total}  configurations failed: {len(errors)}  wrote {path}")
    return 1 if wrong_total or errors or not summary else 0


if __name__ == "__main__":
    sys.exit(main())
