import pytest

from kvxfer.metrics import Metrics, percentile


@pytest.mark.parametrize(
    ("intervals", "busy"),
    [
        ([], 0.0),
        ([(0, 1), (0.5, 2), (3, 4)], 3.0),
        ([(0, 10), (1, 2), (3, 4)], 10.0),
        ([(0, 1), (1, 3)], 3.0),
    ],
)
def test_busy_time_merges_overlaps(intervals, busy):
    m = Metrics()
    for s, e in intervals:
        m.record_batch(s, e, 1, 1)
    assert m.snapshot()["busy_s"] == pytest.approx(busy)


def test_percentile_nearest_rank():
    v = list(range(1, 101))
    assert percentile(v, 50) == 50 and percentile(v, 90) == 90 and percentile(v, 99) == 99
    assert percentile([], 50) == 0.0 and percentile([7.0], 99) == 7.0


def test_throughput_over_busy_time_when_transfers_overlap():
    m = Metrics()
    m.record_batch(0.0, 1.0, 100, 1)
    m.record_batch(0.5, 1.5, 100, 1)  # overlaps: busy 1.5 s, not 2 s
    m.record_batch(10.0, 10.5, 100, 1)
    m.record_done([0.1, 0.2, 0.3])
    m.record_handshake("P", 0.01, "ipc")
    s = m.snapshot()
    assert s["bytes"] == 300 and s["busy_s"] == pytest.approx(2.0)
    assert s["throughput_Bps"] == pytest.approx(150.0)
    assert s["transfers"] == 3 and s["p50_s"] == 0.2 and s["p99_s"] == 0.3
    assert s["transports"] == {"P": "ipc"} and s["handshakes"] == 1


def test_record_batch_adds_ops_calls_and_dedup_bytes():
    m = Metrics()
    m.record_batch(0.0, 1.0, 10, 3, 100)
    m.record_batch(2.0, 3.0, 20, 2)
    s = m.snapshot()
    assert s["ops_calls"] == 5 and s["dedup_bytes"] == 100 and s["bytes"] == 30


def test_a_long_run_keeps_recent_percentiles_and_exact_busy_time_in_bounded_memory():
    """Past ``max_samples`` the percentiles follow the latest transfers (not the first ones,
    frozen), and busy time still counts every interval, overlaps once."""
    m = Metrics(max_samples=4)
    m.record_done([9.0] * 10)  # an early slow spell
    m.record_done([0.1, 0.2, 0.3, 0.4])
    for k in range(1000):  # pairs of overlapping transfers, 1 s apart
        m.record_batch(k, k + 0.5, 1, 1)
        m.record_batch(k + 0.25, k + 0.75, 1, 1)
    s = m.snapshot()
    assert s["transfers"] == 14 and s["p50_s"] == 0.2 and s["p99_s"] == 0.4
    assert s["busy_s"] == pytest.approx(750.0) and s["bytes"] == 2000
    assert len(m._latency) == 4 and not hasattr(m, "_intervals")
