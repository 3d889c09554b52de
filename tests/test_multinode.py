"""Two nodes on one machine: two network namespaces joined by a veth pair, one ``torchrun --nnodes=2`` in each, the
c10d rendezvous on the head node's veth address and ``job.interface`` naming the veth on both. The job's traffic
crosses the link, and the run equals the in-process run bit for bit."""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

from tiny import LAUNCH_TIMEOUT_S, ROOT, TINY_OVERRIDES, read_run, run_one_thread, torchrun

TINY = [*TINY_OVERRIDES, "server.rpc_timeout_s=60"]
"""Ten rounds of K=3 of M=6 clients: a world of 3 is the server (rank 0) and two client workers (ranks 1, 2)."""
IFNAME = "hosfl0"
"""The veth end is renamed to this in both namespaces, so one ``job.interface`` serves both nodes."""
RDZV_PORT = 29400  # the head namespace is new and empty: no other listener can hold the port

pytestmark = [pytest.mark.multiprocess]


@dataclass(frozen=True)
class Node:
    ns: str
    """The network namespace standing in for the machine."""
    addr: str
    """Its address on the link, the one every rank of the node binds to."""


def _ip(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=False)


def _link_bytes(node: Node) -> tuple[int, int]:
    """(received, sent) bytes on the node's end of the link."""
    (link,) = json.loads(_ip("-n", node.ns, "-s", "-j", "link", "show", IFNAME).stdout)
    return link["stats64"]["rx"]["bytes"], link["stats64"]["tx"]["bytes"]


@pytest.fixture
def two_nodes():
    """(head, other): two namespaces on 10.77.<x>.0/24 joined by a veth pair, ``lo`` and the link up in each.

    Skips, naming the command and its error, where they cannot be made (not root, no iproute2, no CAP_SYS_ADMIN).
    Afterwards, pass or fail, every process left in them is killed and both are deleted (with them the veth pair).
    """
    if os.geteuid() != 0:
        pytest.skip(f"network namespaces need root (euid {os.geteuid()})")
    missing = [tool for tool in ("ip", "unshare") if shutil.which(tool) is None]
    if missing:
        pytest.skip(f"network namespaces need {' and '.join(missing)} (iproute2, util-linux): not on PATH")
    tag = uuid.uuid4().hex[:6]
    subnet = f"10.77.{random.randrange(1, 255)}"
    head, other = Node(f"hosfl-a-{tag}", f"{subnet}.1"), Node(f"hosfl-b-{tag}", f"{subnet}.2")
    ends = {head: f"hosfl-a{tag}", other: f"hosfl-b{tag}"}  # ≤ 15 characters, unique in the root namespace
    steps = [
        ["netns", "add", head.ns],
        ["netns", "add", other.ns],
        ["link", "add", ends[head], "type", "veth", "peer", "name", ends[other]],
    ]
    for node, end in ends.items():
        steps += [
            ["link", "set", end, "netns", node.ns],
            ["-n", node.ns, "link", "set", end, "name", IFNAME],
            ["-n", node.ns, "addr", "add", f"{node.addr}/24", "dev", IFNAME],
            ["-n", node.ns, "link", "set", IFNAME, "up"],
            ["-n", node.ns, "link", "set", "lo", "up"],  # TensorPipe's shm transport and a node's own sockets
        ]
    try:
        for step in steps:
            done = _ip(*step)
            if done.returncode != 0:
                pytest.skip(f"cannot make two network namespaces: `ip {' '.join(step)}` failed: {done.stderr.strip()}")
        # each node in a pid namespace of its own too, as on two machines: TensorPipe's CMA channel
        # (process_vm_readv) would otherwise carry tensors between the nodes without touching the link
        probe = subprocess.run(
            ["ip", "netns", "exec", head.ns, "unshare", "--pid", "--fork", "true"], capture_output=True, text=True
        )
        if probe.returncode != 0:
            pytest.skip(f"cannot start a pid namespace: `unshare --pid --fork true` failed: {probe.stderr.strip()}")
        yield head, other
    finally:
        for node, end in ends.items():
            if node.ns in _ip("netns", "list").stdout:
                for pid in _ip("netns", "pids", node.ns).stdout.split():
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(int(pid), signal.SIGKILL)
                _ip("netns", "delete", node.ns)
            _ip("link", "delete", end)  # left in the root namespace only if the setup stopped early


def _node_command(node: Node, head: Node, nproc: int, rdzv_id: str, out_dir: Path) -> list[str]:
    """One node's launch line: the same torchrun a real node runs, inside its namespaces.

    The head hosts the rendezvous store (``is_host``: torch cannot tell, since the veth address is not what this
    machine's hostname resolves to). ``--local-addr`` is the address the node announces: the shared store and
    MASTER_ADDR are the head's, and c10d orders the nodes by it, so the head (.1) is node 0 and holds global rank 0,
    the server (``--node-rank`` would be ignored).
    """
    return [
        *("ip", "netns", "exec", node.ns, "unshare", "--pid", "--fork"),
        *(sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--nproc-per-node={nproc}"),
        *("--rdzv-backend=c10d", f"--rdzv-endpoint={head.addr}:{RDZV_PORT}", f"--rdzv-id={rdzv_id}"),
        f"--rdzv-conf=is_host={int(node == head)}",
        f"--local-addr={node.addr}",
        *("-m", "hosfl_dist.run", *TINY, f"job.interface={IFNAME}", f"job.out_dir={out_dir}"),
    ]


def _launch(commands: dict[Node, list[str]], logs: Path, timeout: float = LAUNCH_TIMEOUT_S) -> dict[Node, str]:
    """Start every node's command at once; wait for all; their return codes must be 0. The output of each node.
    Whatever outlives ``timeout`` is killed (the launcher is pid 1 of its pid namespace: the node's ranks go too)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    env["LOGLEVEL"] = "INFO"  # torchrun's agent logs its rendezvous result: master_addr, the node's global ranks
    procs, files = {}, {}
    try:
        for node, cmd in commands.items():
            files[node] = (logs / f"{node.ns}.log").open("w")
            procs[node] = subprocess.Popen(
                cmd, cwd=ROOT, env=env, stdout=files[node], stderr=subprocess.STDOUT, start_new_session=True
            )
        deadline = time.monotonic() + timeout
        for proc in procs.values():
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                break
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        for f in files.values():
            f.close()
    outs = {node: (logs / f"{node.ns}.log").read_text() for node in commands}
    report = "\n".join(f"--- {node.ns} (rc {p.returncode}):\n{outs[node][-3000:]}" for node, p in procs.items())
    assert all(p.returncode == 0 for p in procs.values()), f"a node failed or outlived {timeout} s:\n{report}"
    return outs


def _rendezvous(out: str) -> tuple[str, list[int]]:
    """(MASTER_ADDR, the node's global ranks) from torchrun's agent log."""
    master = re.search(r"master_addr=(\S+)", out)
    ranks = re.search(r"global_ranks=\[([\d, ]*)\]", out)
    assert master and ranks, out[-3000:]
    return master.group(1), [int(r) for r in ranks.group(1).split(",")]


@pytest.mark.slow  # 35-50 s: two torchruns and the in-process reference on two cores
def test_two_nodes_over_a_veth_link_equal_the_in_process_run(tmp_path, two_nodes):
    head, other = two_nodes
    before = _link_bytes(head)
    out_dir = tmp_path / "run"  # the same path on both nodes, as on a shared filesystem: only rank 0 writes it
    rdzv_id = uuid.uuid4().hex[:8]
    outs = _launch(
        {
            head: _node_command(head, head, 2, rdzv_id, out_dir),  # the server and the leader worker
            other: _node_command(other, head, 1, rdzv_id, out_dir),  # the second worker, across the link
        },
        tmp_path,
    )
    received, sent = (now - then for now, then in zip(_link_bytes(head), before, strict=True))

    # the ranks ran where intended, and met at the head's link address
    assert _rendezvous(outs[head]) == (head.addr, [0, 1])
    assert _rendezvous(outs[other]) == (head.addr, [2])
    assert "[server]   rank 0: server" in outs[head] and "[server]   rank 2: worker" in outs[head]
    assert f"[server] gloo and TensorPipe bound to {IFNAME} (job.interface)" in outs[head]
    # worker 2's activations, gradients, syncs and all_reduce went over the veth: the tiny run moves ~127 kB of
    # training traffic in all; an idle link carries < 1 kB (IPv6 neighbour discovery)
    assert received > 32_000 and sent > 32_000, (received, sent)

    rows, summary = read_run(out_dir)
    ref_rows, ref = run_one_thread([*TINY, f"job.out_dir={tmp_path / 'reference'}"])
    assert summary["status"] == "completed" and summary["roles"]["interface"] == IFNAME
    assert rows == ref_rows
    assert set(summary["client_digests"].values()) == set(ref["client_digests"].values())
    assert summary["server_digest"] == ref["server_digest"]
    assert summary["comm"] == ref["comm"]
    assert summary["rounds"] == ref["rounds"] and summary["processed_samples"] == ref["processed_samples"]


def test_an_interface_the_node_lacks_stops_the_run_with_one_line(tmp_path):
    target = ["-m", "hosfl_dist.run", *TINY, "job.interface=nosuch0", f"job.out_dir={tmp_path / 'run'}"]
    rc, out, _ = torchrun(2, target)
    assert rc != 0, out[-3000:]
    lines = [line for line in out.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, out[-3000:]  # rank 0 says it; the others stop without a word
    have = ", ".join(sorted(os.listdir("/sys/class/net")))
    assert lines[0] == f"error: job.interface=nosuch0: this node has no such interface (it has {have})"
    assert re.search(r"rank\s*: 0 \(local_rank: 0\)\s*\n\s*exitcode\s*: 2 ", out), out[-3000:]  # bad input: 2
