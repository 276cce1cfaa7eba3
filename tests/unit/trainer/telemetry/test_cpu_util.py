"""A step's core utilisation from /proc/stat: busy over total jiffies between two readings."""

from __future__ import annotations

from pathlib import Path

from lorarl.trainer.telemetry.cpu_util import cpu_times, read_cpu_times, utilisation

# user nice system idle iowait irq softirq steal guest guest_nice
BEFORE = "cpu  100 0 50 800 50 0 0 0 30 0\ncpu0 50 0 25 400 25 0 0 0 15 0\nintr 1\n"
AFTER = "cpu  250 0 100 850 50 0 0 0 60 0\ncpu0 125 0 50 425 25 0 0 0 30 0\nintr 2\n"


def test_busy_is_everything_but_idle_and_iowait_and_guest_is_not_counted_twice() -> None:
    assert cpu_times(BEFORE) == (150, 1000)
    assert cpu_times(AFTER) == (350, 1250)


def test_utilisation_is_the_busy_share_of_the_time_between_two_readings() -> None:
    assert utilisation(cpu_times(BEFORE), cpu_times(AFTER)) == 200 / 250
    assert utilisation(cpu_times(AFTER), cpu_times(AFTER)) is None  # no time passed
    assert utilisation(None, cpu_times(AFTER)) is None


def test_an_unreadable_or_foreign_stat_is_no_figure_not_an_error(tmp_path: Path) -> None:
    assert cpu_times("intr 1\n") is None
    assert cpu_times("cpu 1 2\n") is None
    assert read_cpu_times(tmp_path / "missing") is None
    (tmp_path / "stat").write_text("cpu  a b c d e f g h\n")
    assert read_cpu_times(tmp_path / "stat") is None


def test_this_machine_reads_and_a_busy_loop_shows_up() -> None:
    before = read_cpu_times()
    assert before is not None and 0 < before[0] < before[1]
    x = 0
    for i in range(3_000_000):
        x += i
    assert 0 < utilisation(before, read_cpu_times()) <= 1  # type: ignore[operator]
