import pytest

from kvxfer.metrics import Metrics, busy_time, percentile


def test_busy_time_merges_overlaps():
    assert busy_time([]) == 0.0
    assert busy_time([(0, 1), (0.5, 2), (3, 4)]) == pytest.approx(3.0)
    assert busy_time([(0, 10), (1, 2), (3, 4)]) == pytest.approx(10.0)
    assert busy_time([(5, 6), (0, 1)]) == pytest.approx(2.0)


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


def test_record_ops_adds_both_counters():
    m = Metrics()
    m.record_ops(3, 100)
    m.record_ops(2, 0)
    s = m.snapshot()
    assert s["ops_calls"] == 5 and s["dedup_bytes"] == 100
