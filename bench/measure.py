"""What the guest saw, from its stall-meter and tick lines as they arrived on the host.

The stall meter (scripts/guest/init, `backstop.stallmeter=1`) prints a line every ~20 ms of guest
time carrying the guest's clock (`t_us`) and the longest gap its own clock saw between two of its
~1 ms wake-ups (`max_us`). Two facts make three figures out of that:

- A stopped VM's clocks stop with it (under TCG and KVM alike QEMU freezes guest time while the VM
  is stopped), so a stop never shows in `max_us`. It shows on the host: the line after it arrives
  late by the stop's length while its `t_us` does not move on. The offset host arrival - `t_us`
  steps up by exactly the time the guest was stopped: **stopped_ms**, median offset after the
  snapshot minus median offset before (robust to one late read).
- A VM that runs but is slowed (a vCPU blocked on a write-protect fault, the big lock held by the
  migration thread) does see time pass: **guest_clock_stall_ms**, the largest `max_us` while the
  snapshot ran.
- What a client of the workload sees: **silence_ms**, the longest gap between two lines arriving
  on the host, minus the usual gap. It carries both, plus the host's own read jitter.

A quiet window of the same shape with no snapshot gives each figure's noise floor.
"""

import statistics

from guestlog import stall_lines, ticks

AFTER_SETTLE_S = 0.3  # lines this long after the request returned are past the event
SIDE_S = 2.0  # seconds of lines either side for the offset medians


def _median(xs):
    return statistics.median(xs) if xs else None


def snapshot_view(lines, t_req, t_done):
    """Guest-side figures for an event (a snapshot, or a quiet window) between t_req and t_done."""
    s = stall_lines(lines)
    before = [x for x in s if t_req - SIDE_S <= x[0] < t_req]
    after = [x for x in s if t_done + AFTER_SETTLE_S <= x[0] < t_done + AFTER_SETTLE_S + SIDE_S]
    during = [x for x in s if t_req <= x[0] < t_done + AFTER_SETTLE_S]
    if len(before) < 5 or len(after) < 5:
        return {"error": f"too few stall-meter lines around the event ({len(before)} before, {len(after)} after)"}
    off_b = _median([a - t / 1e6 for a, _, t, _ in before])
    off_a = _median([a - t / 1e6 for a, _, t, _ in after])
    gaps_before = [b[0] - a[0] for a, b in zip(before, before[1:])]
    usual = _median(gaps_before)
    # The first line after the event still reports the window the event ended in.
    span = during + after[:1]
    prev = before[-1]
    longest = 0.0
    for x in span:
        longest = max(longest, x[0] - prev[0])
        prev = x
    return {
        "stopped_ms": (off_a - off_b) * 1e3,
        "guest_clock_stall_ms": max((x[3] for x in span), default=0) / 1e3,
        "silence_ms": max(0.0, longest - usual) * 1e3,
        "usual_gap_ms": usual * 1e3,
        "lines_during": len(during),
    }


def rollback_view(lines, t_req, snap_t_req):
    """Request -> the guest running at the snapshot point, in the guest's own output.

    The stall meter's seq and the workload's tick counter live in RAM, so after a restore they
    go back: the first line whose counter is below the last one printed before the request is
    the restored guest speaking. Returns ms from the request to that line (stall meter, every
    ~20 ms) and to the first workload tick (every ~0.5 s), and the counters as a check that the
    guest is at the snapshot point.
    """
    s = stall_lines(lines)
    tk = ticks(lines)
    out = {}
    pre = [x for x in s if x[0] < t_req]
    at_snap = [x for x in s if x[0] < snap_t_req]
    if pre and at_snap:
        last = pre[-1][1]
        first = next((x for x in s if x[0] >= t_req and x[1] < last), None)
        if first:
            out["guest_running_ms"] = (first[0] - t_req) * 1e3
            out["seq_before"] = last
            out["seq_at_snapshot"] = at_snap[-1][1]
            out["seq_restored"] = first[1]
    pre_t = [x for x in tk if x[0] < t_req]
    at_snap_t = [x for x in tk if x[0] < snap_t_req]
    if pre_t and at_snap_t:
        last = pre_t[-1][1]
        first = next((x for x in tk if x[0] >= t_req and x[1] < last), None)
        if first:
            out["first_tick_ms"] = (first[0] - t_req) * 1e3
            out["tick_ram_at_snapshot"] = at_snap_t[-1][1]
            out["tick_restored"] = {"ram": first[1], "disk": first[2]}
    if "guest_running_ms" not in out:
        out["error"] = "the restored guest was not seen on the serial console"
    return out
