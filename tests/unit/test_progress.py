"""The stages' one progress bar helper: on stderr, off when it is not a terminal, left on screen when it is."""

from __future__ import annotations

import io
import os
import pty

from slimectl.contract.logs import progress


class FakeTTY(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_off_when_the_stream_is_not_a_terminal():
    out = io.StringIO()
    with progress(total=3, file=out, desc="train", unit="step") as bar:
        bar.update(3)
    assert bar.disable and out.getvalue() == ""


def test_shown_and_left_visible_on_a_terminal():
    out = FakeTTY()
    with progress(total=3, file=out, desc="train", unit="step") as bar:
        assert not bar.disable and bar.leave
        for _ in range(3):
            bar.update(1)
    text = out.getvalue()
    # the finished bar is the last thing written and ends the line: it stays on screen
    assert "train: 100%" in text.rsplit("\r", 1)[-1] and "3/3" in text and text.endswith("\n")


def test_a_real_pty_counts_as_a_terminal_and_modes_override():
    master, slave = pty.openpty()
    try:
        with os.fdopen(slave, "w", closefd=False) as tty:
            bar = progress(total=1, file=tty, desc="sync", unit="bucket")
            assert not bar.disable and bar.leave
            bar.close()
            assert progress(total=1, file=tty, mode="off").disable
    finally:
        os.close(master)
        os.close(slave)
    forced = progress(total=1, file=io.StringIO(), mode="on")
    assert not forced.disable
    forced.close()


def test_log_lines_print_above_a_shown_bar_not_into_it():
    import logging

    from slimectl.contract.logs import _ConsoleHandler

    out = FakeTTY()
    handler = _ConsoleHandler(out)
    handler.setFormatter(logging.Formatter("%(message)s"))
    with progress(total=2, file=out, desc="train", unit="step") as bar:
        bar.update(1)
        handler.emit(logging.LogRecord("slimectl.train", logging.INFO, __file__, 1, "step 1: loss 0.5", None, None))
        bar.update(1)
    screen_lines = [line.rsplit("\r", 1)[-1] for line in out.getvalue().split("\n")]
    # what stays on each terminal line is the text after its last carriage return
    assert "step 1: loss 0.5" in screen_lines, screen_lines
    assert any(line.startswith("train: 100%") for line in screen_lines), screen_lines
