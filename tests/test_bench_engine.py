"""bench_engine runs (small) on CPU and reports host cost per phase and both transports' bandwidth."""

import json

from tests.test_profiling import _run


def test_bench_engine_small():
    res = _run("bench_engine.py", "--host-iters", "10", "--tokens", "256", "--reqs", "2", "--iters", "1")
    assert res.returncode == 0, res.stdout + res.stderr
    data = json.loads(res.stdout.strip().splitlines()[-1])
    assert data["bench"] == "engine"
    for case in ("1x4096", "8x4096", "8x2K-4K"):
        row = data["host_cost"][case]
        parts = ("export_us", "load_us", "loader_us", "exporter_us", "poll_us")
        assert all(row[k] > 0 for k in parts), row
        assert 0 < row["ops_checks_us"] < row["loader_us"]
        # each process's share: P's and D's phases, which together make the whole
        assert row["p_side_us"] > row["export_us"] and row["d_side_us"] > row["loader_us"]
    assert {b["transport"] for b in data["bandwidth"]} == {"ipc", "pg"}
    for b in data["bandwidth"]:
        assert b["fraction_of_memcpy"] > 0 and b["transport_used"] == {"P": b["transport"]}
    pg = next(b for b in data["bandwidth"] if b["transport"] == "pg")
    assert pg["link_GBps"] > 0 and pg["fraction_of_link"] > 0  # against the raw Gloo link too
    assert "on D (loader)" in res.stdout and "the Gloo link itself" in res.stdout
    assert "DESIGN target <= 50 us" in res.stdout
    floor = data["floor"]  # the least any design costs, interleaved with the engine's runs
    assert floor["total_us"] > 0 and floor["engine_ratio"] > 0 and floor["rounds"] >= 1
    assert "least any design's path costs here" in res.stdout
    floor8 = data["floor_batch8"]  # the same steps for 8 requests at a time, per request
    assert floor8["total_us"] > 0 and floor8["engine_ratio"] > 0
    assert "the same in batches of 8" in res.stdout
    f1 = data["floor_onesided"]  # the one-sided path's floor per side, interleaved with the engine's
    assert f1["p_side_us"] > 0 and f1["d_side_us"] > 0 and f1["p_ratio"] > 0 and f1["d_ratio"] > 0
    assert "least a one-sided request costs here" in res.stdout
    assert data["warm_vs_cold"]["warm_us"] > 0 and data["warm_vs_cold"]["cold_us"] > 0
    # the one-request cases again, each caller's step after a 10 ms pause (the default)
    for case in ("1x4096@10ms", "1x4096-1s@10ms"):
        row = data["host_cost"][case]
        assert all(row[k] > 0 for k in ("export_us", "load_us", "poll_us", "p_side_us", "d_side_us")), row
    assert data["host_cost"]["1x4096@10ms"]["loader_us"] > 0  # the messaged path's batch is timed too
    assert all(v > 0 for v in data["targets"]["idle_reference_us"])
    assert "the reference loop after 10 ms idle" in res.stdout


def test_bench_host_floor_small():
    """The floor benchmark runs each step any design must take, every copy reaching the null
    kernel, and prints the engine's own figure of the same run beside it."""
    res = _run("bench_host_floor.py", "--iters", "20")
    assert res.returncode == 0, res.stdout + res.stderr
    data = json.loads(res.stdout.strip().splitlines()[-1])
    assert data["bench"] == "host_floor" and data["engine_us"] > 0
    for mode in ("cold", "warm"):
        steps = [data[mode][f"{k}_us"] for k in ("export", "load", "grant", "copy", "notify", "poll")]
        assert all(v > 0 for v in steps), data[mode]
        assert data[mode]["total_us"] > 0
    assert "target <= 50 us" in res.stdout
    for mode in ("cold", "warm"):  # the one-sided path's steps, per side
        got = data["onesided"][mode]
        assert all(got[f"{k}_us"] > 0 for k in ("export", "load", "check", "free")), got
        assert got["p_side_us"] > got["export_us"] and got["d_side_us"] > got["load_us"], got
    assert all(v > 0 for v in data["onesided_engine"].values())
    assert "least host cost of one one-sided 4K-token request" in res.stdout


def test_host_steps_times_each_step_of_a_request():
    """host_steps wraps the engine's steps in timers over bench_engine's loop: every step of the
    one-sided path is timed once per request (the warm-up requests left out)."""
    res = _run("host_steps.py", "--iters", "12", "--idle-ms", "1")
    assert res.returncode == 0, res.stdout + res.stderr
    data = json.loads(res.stdout.strip().splitlines()[-1])
    assert data["bench"] == "host_steps" and data["path"] == "onesided" and data["idle_ms"] == 1
    rows = {r["step"]: r for r in data["rows"]}
    # the native lane: one call looks a load up, one lands it; an export is one native call too
    # (the Python paths' steps idle)
    for step in ("TransferEngine.export", "ExportTracker.export_plain", "TransferEngine.load", "OneSided.load_native",
                 "LoadBook.begin", "PreparedCopy.run_bounded", "NativeLane.complete", "LoadBook.complete"):  # fmt: skip
        assert rows[step]["calls"] == 12 and rows[step]["median_us"] > 0, rows[step]
    # the first load of the peer is a warm-up one; the lane's metrics are the book's; P's done
    # marks are taken by its native book (every tick while an export is live)
    for step in ("OneSided.try_load", "OneSided._land", "KVTransferParams.from_dict", "Metrics.record_loads",
                 "ExportTracker.count_marks", "EngineSecret.export_token", "ExportTracker.add",
                 "engine.check_block_ids"):  # fmt: skip
        assert rows[step]["calls"] == 0, rows[step]
    assert rows["ExportTracker.take_marks"]["calls"] >= 12
    assert rows["Loader._run_batch"]["calls"] == 0  # only the handshaking warm-up load takes it
    # a landed one-sided load's done marks free it; its notification goes later, coalesced
    assert rows["Loader.notify_ids"]["calls"] < 12, rows["Loader.notify_ids"]
    assert rows["TransferEngine.load"]["median_us"] > rows["OneSided.load_native"]["median_us"]  # nested


def test_host_steps_messaged_whole_load_plans_nothing():
    """The messaged path's lone whole load goes through the session's prepared whole-block copies
    (IpcSession.start_whole) with nothing planned: no plan_batch, no general start."""
    res = _run("host_steps.py", "--iters", "12", "--idle-ms", "0", "--path", "messaged")
    assert res.returncode == 0, res.stdout + res.stderr
    data = json.loads(res.stdout.strip().splitlines()[-1])
    assert data["path"] == "messaged"
    rows = {r["step"]: r for r in data["rows"]}
    for step in ("Loader._run_batch", "loader.ask_grants", "IpcSession.start_whole", "PreparedCopy.run_bounded",
                 "IpcCompletion.wait", "planner.stale_loads", "Loader._send_notify", "Exporter._handle_notify"):  # fmt: skip
        assert rows[step]["calls"] == 12, rows[step]
    for step in ("Planner.plan", "IpcSession.start", "IpcSession.copy", "OneSided.load_native"):
        assert rows[step]["calls"] == 0, rows[step]
