"""kvxfer's log lines reach a vLLM server's log (kvxfer.vllm.logs), and only when nobody else
configured logging. vLLM itself is not needed: its ``vllm`` logger is configured here as vLLM
configures it (a handler of its own, no propagation)."""

from __future__ import annotations

import logging

import pytest

from kvxfer.vllm.logs import join_vllm_logging


class _Keep(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture
def loggers():
    """The ``kvxfer``, ``vllm`` and root loggers as a fresh process has them, restored after."""
    kv, vl, root = logging.getLogger("kvxfer"), logging.getLogger("vllm"), logging.getLogger()
    saved = [(lg, list(lg.handlers), lg.level, lg.propagate) for lg in (kv, vl, root)]
    for lg in (kv, vl, root):
        lg.handlers = []
        lg.setLevel(logging.NOTSET)
    root.setLevel(logging.WARNING)
    yield kv, vl, root
    for lg, handlers, level, propagate in saved:
        lg.handlers, lg.propagate = handlers, propagate
        lg.setLevel(level)


def test_kvxfer_info_lines_go_to_vllms_handler(loggers):
    kv, vl, root = loggers
    root.handlers = []  # pytest's capture handlers, added after the fixture ran
    h = _Keep()
    vl.addHandler(h)
    vl.setLevel(logging.INFO)
    vl.propagate = False
    logging.getLogger("kvxfer.transports.ipc.onesided").info("before")  # lost: nobody listens
    assert join_vllm_logging() is True
    logging.getLogger("kvxfer.transports.ipc.onesided").info("one-sided: %s", "no live slot")
    logging.getLogger("kvxfer.vllm.worker").debug("below vLLM's level")
    assert h.lines == ["one-sided: no live slot"]
    assert join_vllm_logging() is False and kv.handlers == [h]  # idempotent: no second handler


@pytest.mark.parametrize("who", ["root", "kvxfer", "no vllm handler"])
def test_left_alone_when_someone_configured_logging(loggers, who):
    kv, vl, root = loggers
    root.handlers = []  # pytest's capture handlers, added after the fixture ran
    if who == "root":
        root.addHandler(_Keep())
    elif who == "kvxfer":
        kv.setLevel(logging.DEBUG)
    if who != "no vllm handler":
        vl.addHandler(_Keep())
    assert join_vllm_logging() is False
    assert kv.handlers == [] and kv.propagate
