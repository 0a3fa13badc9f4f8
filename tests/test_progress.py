"""corrnoise.progress.LineProgress: plain progress lines (also where stderr is not a terminal)."""

from __future__ import annotations

import io

from corrnoise.progress import LineProgress, format_seconds, resolve_progress


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_silent_for_the_first_second_then_a_line_per_phase_with_the_time_left():
    clock, out = Clock(), io.StringIO()
    p = LineProgress("corrnoise plan", stream=out, after=1.0, every=5.0, gap=1.0, clock=clock)
    p("optimizing candidates: dpsgd", 0, 10)
    clock.now += 0.5
    p("optimizing candidates: bandmf:2", 1, 10)
    assert out.getvalue() == ""  # quick work stays silent
    clock.now += 1.5  # 2 s in, 2 of 10 done in this phase -> ~8 s left
    p("optimizing candidates: bandmf:4", 2, 10)
    clock.now += 0.2  # within the gap: no second line
    p("optimizing candidates: bandmf:8", 3, 10)
    clock.now += 5.0  # every 5 s within the phase
    p("optimizing candidates: blt:1", 4, 10)
    p("optimizing candidates", 10, 10)
    lines = out.getvalue().splitlines()
    assert lines[0] == "corrnoise plan [2.0 s] optimizing candidates: bandmf:4 2/10, ~8.0 s left"
    assert lines[1].startswith("corrnoise plan [7.2 s] optimizing candidates: blt:1 4/10, ~")
    assert lines[2] == "corrnoise plan [7.2 s] optimizing candidates: done in 7.2 s"
    assert len(lines) == 3


def test_a_new_phase_gets_its_own_line_and_its_own_rate():
    clock, out = Clock(), io.StringIO()
    p = LineProgress("x", stream=out, after=0.0, every=60.0, gap=0.0, clock=clock)
    p("verifying: chunks", 0, 100)
    clock.now += 10.0
    p("verifying: chunks", 50, 100)  # same phase, before `every`: no line
    p("done", 1, 1)  # a phase that ends without having been shown prints nothing
    assert out.getvalue().splitlines() == ["x [0.0 s] verifying: chunks 0/100"]


def test_format_seconds_and_resolution():
    assert [format_seconds(s) for s in (0.44, 12.4, 185.0)] == ["0.4 s", "12 s", "3 min 05 s"]
    assert isinstance(resolve_progress(True), LineProgress)


def test_a_closed_stream_does_not_stop_the_work():
    out = io.StringIO()
    out.close()
    p = LineProgress(stream=out, after=0.0, gap=0.0)
    p("phase", 0, 2)  # no exception


def test_a_phase_that_encloses_others_reports_its_own_duration():
    clock, out = Clock(), io.StringIO()
    p = LineProgress("x", stream=out, after=0.0, every=60.0, gap=0.0, clock=clock)
    p("verifying C (~40 s)", 0, 1)
    clock.now += 3.0
    p("verifying C (~40 s), verifying chunks", 0, 10)
    clock.now += 30.0
    p("verifying C (~40 s), verifying chunks", 10, 10)
    p("verifying C (~40 s)", 1, 1)
    assert out.getvalue().splitlines()[-1] == "x [33 s] verifying C (~40 s): done in 33 s"
