"""The whole-job stop's pure parts: `--stop-signal` parsing (every refusal names the flag, the value and what is
valid), the exit codes a scheduler decides a job's next step by, and the head refusing `--stop-signal` without a
persistent tier before it starts anything. The stop itself, end to end under a real Slurm, is in
tests/test_slurm.py (`test_job_notice_stops_saved_requeues_and_resumes`)."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

from phoenixft.controlplane import sealed
from phoenixft.controlplane.values import parse_drain_request
from phoenixft.errors import UserError
from phoenixft.runtime.exitcode import DONE, FAILED, INTERRUPTED_CODE, RESUMABLE, exit_code
from phoenixft.runtime.stopsignal import TERM_OVERDUE_S, TERM_WINDOW_S, StopOnSignal, parse_stop_signals, term_stops


def test_stop_signals_parse_by_name_or_number_once_each() -> None:
    assert parse_stop_signals("") == []
    assert parse_stop_signals("SIGUSR1") == [signal.SIGUSR1]
    assert parse_stop_signals("USR2, SIGTERM") == [signal.SIGUSR2, signal.SIGTERM]
    assert parse_stop_signals(f"{int(signal.SIGUSR1)},SIGUSR1") == [signal.SIGUSR1]


@pytest.mark.parametrize("text, why", [("FOO", "'FOO' is not a signal name"), ("SIGKILL", "SIGKILL cannot be caught"),
                                       ("SIGUSR1,SIGINT", "SIGINT cannot be caught"),
                                       ("SIGHUP", "use SIGUSR1, SIGUSR2 or SIGTERM")])
def test_stop_signals_refused_in_one_line(text: str, why: str) -> None:
    with pytest.raises(UserError) as e:
        parse_stop_signals(text)
    assert str(e.value).startswith(f"--stop-signal={text}: ") and why in str(e.value), str(e.value)


def test_exit_codes_say_requeue_or_not() -> None:
    assert exit_code({"state": "done"}) == DONE == 0
    assert exit_code({"state": "stopped"}) == RESUMABLE == 75
    assert exit_code({"state": "failed: interrupted"}) == INTERRUPTED_CODE == 130
    for state in ("failed: every node is lost", "failed: did not start", None):
        assert exit_code({"state": state}) == FAILED == 1


def test_a_stop_signal_is_recorded_once_and_written_at_the_next_look() -> None:
    """The handler only records (it may run anywhere in the launcher's loop); `tick` writes one request."""
    writes: list[tuple[str, bytes]] = []

    class _Store:
        def set(self, key: str, value: bytes | str) -> None:
            writes.append((key, value if isinstance(value, bytes) else value.encode()))

    said: list[str] = []
    sealed.bind("Aq3-Zt9_pL0wYv2s" * 2, "run-stop")  # (the request is sealed with the run key, as the head's)
    s = StopOnSignal([signal.SIGUSR1])
    s.tick(_Store(), said.append)  # type: ignore[arg-type]
    assert writes == [] and said == []
    s.on_signal(signal.SIGUSR1, None)
    s.on_signal(signal.SIGUSR1, None)  # (Slurm may send the notice to the script and its processes alike)
    s.tick(_Store(), said.append)  # type: ignore[arg-type]
    s.on_signal(signal.SIGUSR1, None)
    s.tick(_Store(), said.append)  # type: ignore[arg-type]
    assert [k for k, _ in writes] == ["stop/request"], writes
    rec = parse_drain_request(sealed.unseal("stop/request", writes[0][1]), "stop/request")
    sealed.unbind()
    assert rec is not None and rec["reason"] == "SIGUSR1 received" and rec["source"] == "signal", rec
    assert said == ["== SIGUSR1 received: the job stops at the next step boundary with its state saved"]


def test_the_head_refuses_a_stop_signal_without_a_persistent_tier(tmp_path: Path) -> None:
    p = subprocess.run([sys.executable, "-m", "phoenixft", "coordinator", "--host", "127.0.0.1", "--port", "0",
                        "--nodes", "2", "--stop-signal", "SIGUSR1", "--run-dir", str(tmp_path / "run")],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and p.stderr.strip().splitlines()[-1] == (
        "phoenixft coordinator: error: --stop-signal saves the job's state to the persistent tier when it stops: "
        "give --persist-every K and --persist-dir DIR (storage every host mounts)"), p.stderr
    assert not (tmp_path / "run").exists()


def test_sigterm_stops_the_job_only_where_there_is_a_persistent_tier() -> None:
    assert term_stops(0, []) == [] and term_stops(0, [signal.SIGUSR1]) == [signal.SIGUSR1]
    assert term_stops(100, []) == [signal.SIGTERM]
    assert term_stops(100, [signal.SIGUSR1]) == [signal.SIGUSR1, signal.SIGTERM]
    assert term_stops(100, [signal.SIGTERM, signal.SIGUSR2]) == [signal.SIGTERM, signal.SIGUSR2]


def test_a_sigterm_stop_carries_its_deadline_and_ends_the_head_once_overdue() -> None:
    """SIGTERM has no notice before it and SIGKILL follows: its request carries the deadline the coordinator bounds
    its waits by; later SIGTERMs change nothing; a stop still going TERM_OVERDUE_S past it ends the head as Ctrl-C."""
    writes: list[bytes] = []

    class _Store:
        def set(self, key: str, value: bytes | str) -> None:
            writes.append(value if isinstance(value, bytes) else value.encode())

    said: list[str] = []
    sealed.bind("Aq3-Zt9_pL0wYv2s" * 2, "run-stop")
    s = StopOnSignal([signal.SIGUSR1, signal.SIGTERM])
    s.on_signal(signal.SIGTERM, None)
    t = s.pending[1] if s.pending else 0.0
    s.tick(_Store(), said.append)  # type: ignore[arg-type]
    s.on_signal(signal.SIGTERM, None)
    s.on_signal(signal.SIGUSR1, None)
    s.tick(_Store(), said.append)  # type: ignore[arg-type]
    rec = parse_drain_request(sealed.unseal("stop/request", writes[0]), "stop/request")
    sealed.unbind()
    assert len(writes) == 1 and rec is not None and rec["reason"] == "SIGTERM received", (writes, rec)
    assert rec["deadline"] == t + TERM_WINDOW_S and rec["t"] == t, rec
    assert said == [f"== SIGTERM received: the job stops at the next step boundary with its state saved (within "
                    f"{TERM_WINDOW_S:g}s)"]
    assert s.deadline is not None
    s.deadline -= TERM_WINDOW_S + TERM_OVERDUE_S + 1.0  # (as if that long had passed)
    with pytest.raises(KeyboardInterrupt):
        s.tick(_Store(), said.append)  # type: ignore[arg-type]
