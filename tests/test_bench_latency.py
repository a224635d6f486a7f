"""bench_latency on CPU: one request's timeline across P and D for ipc and pg, from the engine's
own trace ranges, with a #wrong that can fail."""

import json

import pytest

from tests.test_profiling import _run


def _stages(stdout: str) -> dict[str, list[str]]:
    return {line.split()[0] + (" " + line.split()[1] if line.split()[0] == "serve" else ""): line.split()
            for line in stdout.splitlines() if line.startswith(" ")}  # fmt: skip


@pytest.mark.parametrize(
    ("transport", "path"), [("ipc", "messaged"), ("ipc", "onesided"), ("pg", "messaged")]
)
def test_bench_latency_prints_each_stage_of_the_path(tmp_path, transport, path):
    res = _run(
        "bench_latency.py", "--device", "cpu", "--transport", transport, "--tokens", "16",
        "--reqs", "3", "--layers", "2", "--paths", path, "--out", str(tmp_path), timeout=180,
    )  # fmt: skip
    assert res.returncode == 0, res.stdout + res.stderr
    assert "#wrong 0" in res.stdout and "wrong requests: 0  OK" in res.stdout
    assert f"{transport}, {path} path" in res.stdout
    got = _stages(res.stdout)
    ms = {k: (float(v[-6]), float(v[-5])) for k, v in got.items()}  # (first start, last end)
    if path == "onesided":  # load() copies: no worker batch, no grant; P frees from the done mark
        assert {"load()", "copy", "done", "freed"} <= set(got), res.stdout
        # and no message on its path: the done mark frees it, the notification goes 0.1 s later
        assert not {"load", "grant", "serve ReadReq", "notify", "serve Notify"} & set(got), res.stdout
        assert all(row[-1] == "3" for row in got.values()), res.stdout
        assert ms["load()"][0] <= ms["copy"][0] <= ms["copy"][1] <= ms["done"][0], ms
        assert ms["copy"][1] <= ms["freed"][0], ms
        assert "the grant round trip is" not in res.stdout
        return
    want = {"load()", "load", "grant", "serve ReadReq", "done", "notify", "serve Notify", "freed"}
    want |= {"copy"} if transport == "ipc" else {"serve SendReq", "gather", "send", "recv", "scatter"}
    assert want <= set(got), res.stdout
    assert all(row[-1] == "3" for row in got.values()), res.stdout  # every warm request has them
    # the path's order: grant before the data moves, the data before D's caller sees the load
    # done and before P's caller sees the blocks freed. Those two are not ordered: D's worker
    # notifies P as soon as the data landed, and P's poll may see it before D's next poll does
    data = "copy" if transport == "ipc" else "scatter"
    assert ms["grant"][1] <= ms[data][0] <= ms[data][1] <= ms["done"][0], ms
    assert ms[data][1] <= ms["freed"][0], ms
    assert ms["grant"][0] <= ms["serve ReadReq"][0] <= ms["grant"][1], ms
    data = json.loads((tmp_path / "bench_latency.json").read_text())
    assert data["meta"]["device"] and len(data["requests"]) == 3
    assert {r["stage"] for r in data["rows"]} >= {"grant", "notify"}
    # the reference: bare zmq round trips between the same processes, and the grant against it
    ref = [line for line in res.stdout.splitlines() if line.startswith("# reference")]
    assert len(ref) == 2 and "bare zmq round trip" in ref[0] and "the grant round trip is" in ref[0], ref
    # and what a pause costs this machine's caches (the loop back to back and after 10 ms idle)
    assert "after 10 ms idle" in ref[1], ref
    assert all(x > 0 for x in data["bare_round_trips"][0]["loop_us_warm_idle"])
    (bare,) = data["bare_round_trips"]
    assert bare["tokens"] == 16 and len(bare["round_trips_ms"]) == 200
    assert all(0 < x < 1000 for x in bare["round_trips_ms"]), bare
    # and the same spaced by the idleness requests see between them
    assert len(bare["spaced_round_trips_ms"]) == 200 and bare["idle_gap_s"] > 0
    assert all(0 < x < 1000 for x in bare["spaced_round_trips_ms"]), bare
    assert "back to back" in ref[0] and "ms idle" in ref[0], ref


def test_bench_latency_detects_a_wrong_byte(tmp_path):
    res = _run(
        "bench_latency.py", "--device", "cpu", "--tokens", "16", "--reqs", "1", "--layers", "2",
        "--corrupt", "--out", str(tmp_path), timeout=180,
    )  # fmt: skip
    assert res.returncode == 1, res.stdout + res.stderr
    assert "#wrong 1" in res.stdout and "WRONG" in res.stdout
