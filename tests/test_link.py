"""The emulated link (hosfl_dist.transport.link): delay math by hand, asynchronous delivery, unchanged results."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
import torch

from hosfl_dist.config import LinkConfig, load_config
from hosfl_dist.runtime.inprocess import InProcessRunner
from hosfl_dist.transport.endpoint import ServerEndpoint
from hosfl_dist.transport.inprocess import InProcessTransport
from hosfl_dist.transport.link import DelayedTransport, LinkQueue
from hosfl_dist.transport.metered import MeteredTransport
from hosfl_dist.transport.wire import DOWNLINK_GRADIENTS, UPLINK_ACTIVATIONS, CommMeter, wire


def test_link_queue_is_serialisation_plus_half_rtt_and_fifo():
    q = LinkQueue(mbps=8.0, rtt_ms=20.0)  # 1 MB = 8 Mbit takes 1 s
    assert q.arrival(0.0, 1_000_000) == pytest.approx(1.010)
    assert q.arrival(0.0, 1_000_000) == pytest.approx(2.010)  # sent together: waits for the first to leave
    assert q.arrival(0.5, 0) == pytest.approx(2.010)  # an empty message still queues behind them, pays RTT/2
    assert q.arrival(5.0, 500_000) == pytest.approx(5.510)  # link idle again
    paper = LinkConfig()  # App. C.1: 30 Mbps up, 200 Mbps down, 30 ms RTT
    assert paper.uplink_s(3_750_000) == pytest.approx(1.015)  # 30 Mbit at 30 Mbps
    assert paper.downlink_s(25_000_000) == pytest.approx(1.015)  # 200 Mbit at 200 Mbps


class HeldClock:
    """time.perf_counter that a test can hold still. While it is held nothing on the link falls due, however loaded
    the machine, and once released it goes on from where it stood: what a test checks in between, and the link's
    schedule, do not depend on how fast the test itself ran."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held_at: float | None = None
        self._lost = 0.0

    def __call__(self) -> float:
        with self._lock:
            return (time.perf_counter() if self._held_at is None else self._held_at) - self._lost

    def hold(self) -> None:
        with self._lock:
            self._held_at = time.perf_counter()

    def release(self) -> None:
        with self._lock:
            self._lost += time.perf_counter() - self._held_at
            self._held_at = None


def until(what: str, ready) -> None:
    """Poll ``ready``; 60 s only catches a hang (it takes well under a second)."""
    deadline = time.monotonic() + 60
    while not ready():
        assert time.monotonic() < deadline, f"not after 60 s: {what}"
        time.sleep(0.01)


class EchoServer:
    """λ = 2z, returned at once; records when each call reached it."""

    def __init__(self, clock):
        self.clock = clock
        self.arrivals = []

    @wire(args={"act": UPLINK_ACTIVATIONS}, result={"lam": DOWNLINK_GRADIENTS})
    def submit(self, client: int, act: torch.Tensor) -> dict:
        self.arrivals.append((client, self.clock()))
        if client < 0:
            raise RuntimeError("server refused the call")
        return {"lam": act * 2}


def test_window_by_hand_and_the_client_computes_while_in_flight():
    """z of 100 kB: 0.1 s up at 8 Mbps, λ 0.1 s down, RTT 0: the window is 0.2 s from the send. The call returns
    before the message can have arrived (the clock is held meanwhile), the server answers while the client computes,
    and the answer is due 0.1 s after the server's, so a client whose work outlasted the trip up waits at most the
    trip down, not the whole window. Checked on the link's own schedule (its trace) and with bounds that say
    "never early", which load cannot break."""
    clock = HeldClock()
    server = EchoServer(clock)
    meter = CommMeter()
    link = DelayedTransport(InProcessTransport(ServerEndpoint(server)), LinkConfig(8.0, 8.0, 0.0), clock, trace=True)
    z = torch.ones(25_000)  # 100 kB
    clock.hold()
    t0 = clock()
    fut = MeteredTransport(link, EchoServer, meter).call_async("submit", client=0, act=z)
    assert not fut.done()  # returned at once, without waiting for the link
    clock.release()
    (rec,) = link.stats.trace
    until("the server answers while the client computes", lambda: "done" in rec)  # the client's perturbed forwards
    waits = clock()
    lam = fut.wait()["lam"]
    end = clock()
    assert torch.equal(lam, 2 * z)
    assert rec["sent"] == t0 and rec["arrive"] == pytest.approx(t0 + 0.1)
    assert rec["back"] == pytest.approx(rec["done"] + 0.1) and rec["back"] <= waits + 0.1
    assert rec["arrive"] <= rec["served"] <= server.arrivals[0][1] <= rec["done"]  # never early, in order
    assert rec["back"] <= rec["answered"] <= end and end - t0 >= 0.2
    assert link.stats.uplink_bytes == link.stats.downlink_bytes == 100_000
    assert link.stats.uplink_s == pytest.approx(0.1) and link.stats.downlink_s == pytest.approx(0.1, abs=1e-3)
    assert meter.bytes[UPLINK_ACTIVATIONS] == meter.bytes[DOWNLINK_GRADIENTS] == 100_000
    link.close()


def test_each_client_has_its_own_link_and_errors_reach_the_caller():
    """Three messages sent at one instant (the clock held): clients 0 and 1 send in parallel, client 0's second
    message waits for its first to leave; they reach the server in that order, none before its time."""
    clock = HeldClock()
    server = EchoServer(clock)
    link = DelayedTransport(InProcessTransport(ServerEndpoint(server)), LinkConfig(8.0, 8.0, 0.0), clock, trace=True)
    z = torch.ones(12_500)  # 50 kB: 0.05 s on an idle link
    clock.hold()
    t0 = clock()
    futs = [link.call_async("submit", client=m, act=z) for m in (0, 1, 0)]
    clock.release()
    for f in futs:
        f.wait()
    assert [m for m, _ in server.arrivals] == [0, 1, 0]
    assert [r["arrive"] - t0 for r in link.stats.trace] == pytest.approx([0.05, 0.05, 0.10])
    assert all(r["arrive"] <= t for r, (_, t) in zip(link.stats.trace, server.arrivals, strict=True))
    with pytest.raises(RuntimeError, match="server refused"):
        link.call("submit", client=-1, act=z)
    link.close()


def run(overrides):
    cfg = load_config(None, overrides)
    engine = InProcessRunner(cfg).setup()
    summary = engine.run()
    rows = [json.loads(line) for line in Path(cfg.job.out_dir, "metrics.jsonl").read_text().splitlines()]
    for r in rows:
        r.pop("wall_time_s")
    return summary, rows, engine.link


def test_engine_results_are_unchanged_by_the_link_with_overlap_on_and_off(tiny_overrides, tmp_path):
    fast = ["comm.inject_delay=true", "comm.rtt_ms=1", "comm.uplink_mbps=2000", "comm.downlink_mbps=2000"]
    ref, ref_rows, plain = run(tiny_overrides)
    assert plain is None
    for i, extra in enumerate((fast, [*fast, "zo.overlap=true"])):
        s, rows, link = run([*tiny_overrides, *extra, f"job.out_dir={tmp_path / str(i)}"])
        assert isinstance(link, DelayedTransport) and link.stats.messages > 0 and link.stats.uplink_s > 0
        assert link.stats.by_method["submit"] == s["rounds"] * 3  # K = 3 activations a round went over the link
        assert rows == ref_rows
        assert s["client_digests"] == ref["client_digests"] and s["server_digest"] == ref["server_digest"]
        assert s["comm"] == ref["comm"]
        assert s["link"]["messages"] == link.stats.messages and s["link"]["rtt_ms"] == 1.0
