"""The periodic one-line status: logged when it changes, never when off, robust to a failing line."""

from __future__ import annotations

import asyncio
import logging

from raykv.metrics import status_log


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _run(line, interval_s: float, seconds: float) -> list[str]:
    handler = _Lines()
    status_log.logger.addHandler(handler)

    async def main() -> None:
        task = status_log.spawn(line, interval_s=interval_s)
        await asyncio.sleep(seconds)  # not a wait: the periodic logger runs for this long (under test)
        task.cancel()

    try:
        asyncio.run(main())
    finally:
        status_log.logger.removeHandler(handler)
    return handler.lines


def test_logs_only_changes() -> None:
    values = iter(["a", "a", "a", "b", "b"] + ["c"] * 100)
    assert _run(lambda: next(values), 0.01, 0.3) == ["a", "b", "c"]


def test_off_and_failing_lines() -> None:
    assert _run(lambda: "never", 0.0, 0.05) == []

    def broken() -> str:
        raise RuntimeError("boom")

    lines = _run(broken, 0.01, 0.1)
    assert lines and lines[0].startswith("status unavailable: RuntimeError('boom')")
