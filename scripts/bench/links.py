"""Plain TCP between two emulated nodes against the links `comm.kind: auto` fits from its gloo probes.

    sudo .venv/bin/python -m scripts.bench.links [--quick] [--rates 1gbit 200mbit]

Per shaped rate, a 2-node cluster of scripts/netem (its own prefix, always torn down) and:
- plain TCP from node 0 to node 1 (a small socket server in one namespace, the client in the other; both read the
  one monotonic clock of this machine, so one-way times need no round trip): a sustained transfer one way, both
  directions at once, 1 MB and 64 KB messages (each alone after a pause, and many back to back) and a ping-pong;
- on 2 nodes x 2 ranks (gloo, as scripts/bench/cluster_tta.py lays them out): the probes of
  `AutoCommunicator._probe_links` (its own code, so the same groups, ops and sizes), the same probes at 2^7 and 2^9
  times their smaller size, and the bytes each sends over node 0's link (its veth counters); each set of points fitted
  by `trainer.comm.cost.build_network`.
The table sets each fitted node-crossing link's bytes/s against the sustained TCP rate (within 10% or not). Results
go to docs/results/links.json (links.quick.json with --quick). Needs root (network namespaces).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, Mapping, Sequence

from scripts.bench import common
from scripts.bench.common import print_table

BENCH = "links"
RATES = ("1gbit", "200mbit")
NODES, RANKS_PER_NODE = 2, 2
NETEM_ENV = {"NETEM_PREFIX": "dawnl", "NETEM_SUBNET": "10.213.3"}  # no other bench's cluster: ours to tear down
PORT, TCP_PORT = 29641, 29651
TOLERANCE = 0.10
SCALES = (2**7, 2**9)
"""The larger probes: auto's smaller size times these (allreduce 2^13 floats -> 2^20 and 2^22)."""
MESSAGES = (2**20, 2**16)
PAUSE_S = 0.02  # between isolated messages: the tbf bucket refills, as before a probe that follows compute


def rate_bytes_per_s(rate: str) -> float:
    """A tc rate ('1gbit', '200mbit', '500kbit') in bytes per second."""
    units = {"gbit": 1e9, "mbit": 1e6, "kbit": 1e3, "bit": 1.0}
    r = rate.lower()
    for unit, bits in units.items():
        if r.endswith(unit):
            return float(r[: -len(unit)]) * bits / 8
    raise ValueError(f"rate must look like 1gbit or 200mbit, got {rate!r}")


# ---------------------------------------------------------------- plain TCP (both ends)

HEADER = struct.Struct("!cQQd")  # mode, bytes per message, messages, the sender's monotonic clock at its start
STAMP = struct.Struct("!d")


def _recv_exact(sock: socket.socket, n: int, buf: memoryview | None = None) -> bytes:
    """Read exactly n bytes (into `buf` when given, returning b'')."""
    view = buf[:n] if buf is not None else memoryview(bytearray(n))
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if not k:
            raise ConnectionError("peer closed the connection")
        got += k
    return b"" if buf is not None else bytes(view)


def _handle(conn: socket.socket) -> None:
    """One client connection: S = receive COUNT messages of N bytes, answer each with the clock at its last byte;
    R = send N bytes after the clock at the start; P = echo N bytes."""
    buf = memoryview(bytearray(1 << 22))
    with conn:
        while True:
            try:
                head = _recv_exact(conn, HEADER.size)
            except ConnectionError:
                return
            mode, n, count, _ = HEADER.unpack(head)
            if mode == b"S":
                for _ in range(count):
                    left = n
                    while left:
                        step = min(left, len(buf))
                        _recv_exact(conn, step, buf)
                        left -= step
                    conn.sendall(STAMP.pack(time.monotonic()))
            elif mode == b"R":
                conn.sendall(STAMP.pack(time.monotonic()))
                _send_bytes(conn, n)
            elif mode == b"P":
                conn.sendall(_recv_exact(conn, n))


def _send_bytes(sock: socket.socket, n: int) -> None:
    chunk = bytes(min(n, 1 << 22))
    view = memoryview(chunk)
    while n:
        step = min(n, len(chunk))
        sock.sendall(view[:step])
        n -= step


def serve(port: int) -> None:
    """The server end (in node 1): a thread per connection, until killed; prints 'ready' once listening."""
    with socket.create_server(("0.0.0.0", port), reuse_port=False) as srv:
        print("ready", flush=True)
        while True:
            conn, _ = srv.accept()
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=_handle, args=(conn,), daemon=True).start()


def _connect(addr: str, port: int) -> socket.socket:
    sock = socket.create_connection((addr, port), timeout=120)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def send_messages(sock: socket.socket, n: int, count: int = 1) -> float:
    """Seconds from the first byte sent to the last received, for `count` messages of n bytes back to back."""
    start = time.monotonic()
    for _ in range(count):
        sock.sendall(HEADER.pack(b"S", n, 1, start))
        _send_bytes(sock, n)
    ends = [STAMP.unpack(_recv_exact(sock, STAMP.size))[0] for _ in range(count)]
    return ends[-1] - start


def receive(sock: socket.socket, n: int) -> float:
    """Seconds from the server's first byte sent to the last byte received here (the reverse direction)."""
    sock.sendall(HEADER.pack(b"R", n, 1, 0.0))
    start = STAMP.unpack(_recv_exact(sock, STAMP.size))[0]
    buf = memoryview(bytearray(min(n, 1 << 22)))
    left = n
    while left:
        step = min(left, len(buf))
        _recv_exact(sock, step, buf)
        left -= step
    return time.monotonic() - start


def ping(sock: socket.socket) -> float:
    """Round-trip seconds of one byte."""
    start = time.perf_counter()
    sock.sendall(HEADER.pack(b"P", 1, 1, 0.0) + b"x")
    _recv_exact(sock, 1)
    return time.perf_counter() - start


def measure_tcp(addr: str, port: int, sustained: int, repeats: int) -> dict[str, Any]:
    """Every plain-TCP figure from this end (node 0) to the server at addr:port, in bytes/s and seconds."""
    up, down, up2 = _connect(addr, port), _connect(addr, port), _connect(addr, port)
    try:
        send_messages(up, 1 << 20)  # warm-up: the connection's window grows
        one_way = statistics.median(send_messages(up, sustained) for _ in range(repeats))
        reverse = statistics.median(receive(down, sustained) for _ in range(repeats))
        both: dict[str, list[float]] = {"up": [], "down": [], "shared": [], "shared2": []}
        for _ in range(repeats):
            _together(lambda: both["up"].append(send_messages(up, sustained)),
                      lambda: both["down"].append(receive(down, sustained)))
            # two flows one way at once: the two local ranks of a node sending over its one link
            _together(lambda: both["shared"].append(send_messages(up, sustained // 2)),
                      lambda: both["shared2"].append(send_messages(up2, sustained // 2)))
        shared = statistics.median(max(a, b) for a, b in zip(both["shared"], both["shared2"]))
        out: dict[str, Any] = {
            "sustained_bytes": sustained, "one_way_bytes_per_s": sustained / one_way,
            "reverse_bytes_per_s": sustained / reverse,
            "duplex_up_bytes_per_s": sustained / statistics.median(both["up"]),
            "duplex_down_bytes_per_s": sustained / statistics.median(both["down"]),
            "two_flows_bytes_per_s": 2 * (sustained // 2) / shared, "messages": {}}
        for n in MESSAGES:
            alone = []
            for _ in range(5 * repeats):
                time.sleep(PAUSE_S)
                alone.append(send_messages(up, n))
            count = max(8, sustained // (4 * n))
            burst = statistics.median(send_messages(up, n, count) for _ in range(repeats))
            alone_s = statistics.median(alone)
            out["messages"][str(n)] = {"alone_s": alone_s, "alone_bytes_per_s": n / alone_s,
                                       "back_to_back": count, "back_to_back_bytes_per_s": n * count / burst}
        out["ping_rtt_s"] = statistics.median(ping(up) for _ in range(20 * repeats))
        return out
    finally:
        for sock in (up, down, up2):
            sock.close()


def _together(*fns: Callable[[], object]) -> None:
    threads = [threading.Thread(target=fn) for fn in fns]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


# ---------------------------------------------------------------- gloo probes (one rank, under run.sh)


class _Recording:
    """A group that records each collective it runs (op, elements, dtype) under the topology's name for it."""

    def __init__(self, group: Any, name: str, calls: list[tuple[str, str, int, Any]]) -> None:
        self._group, self._name, self._calls = group, name, calls

    def __getattr__(self, attr: str) -> Any:
        return getattr(self._group, attr)

    def _rec(self, op: str, method: str) -> Callable[..., Any]:
        def run(t: Any, what: str) -> Any:
            self._calls.append((self._name, op, t.numel(), t.dtype))
            return getattr(self._group, method)(t, what)
        return run

    def all_reduce_(self, t: Any, what: str) -> Any:
        return self._rec("allreduce", "all_reduce_")(t, what)

    def all_gather(self, t: Any, what: str) -> Any:
        return self._rec("allgather", "all_gather")(t, what)

    def reduce_scatter(self, t: Any, what: str) -> Any:
        return self._rec("reduce_scatter", "reduce_scatter")(t, what)


def auto_probes(topo: Any) -> tuple[dict[str, list[tuple[float, float]]], dict[str, tuple[str, str, Any, int]]]:
    """This rank's points of auto's own `_probe_links`, and each probe's (group, op, dtype, smaller size) as it
    ran them: the larger probes repeat exactly these."""
    import torch

    from trainer.comm.auto import AutoCommunicator
    from trainer.comm.cost import layout_of

    calls: list[tuple[str, str, int, Any]] = []
    groups = {name: _Recording(getattr(topo, name), name, calls) for name in ("world", "intra_node", "inter_node")}
    shim = SimpleNamespace(topo=SimpleNamespace(device=topo.device, **groups), net_layout=layout_of(topo),
                           wire16=torch.bfloat16)  # auto's wire without comm.compression
    shim._timed = lambda fn, reps=2: AutoCommunicator._timed(shim, fn, reps)
    points = AutoCommunicator._probe_links(shim)
    runs: list[tuple[str, str, Any, int]] = []  # consecutive calls of one (group, op, dtype): one probe
    for group, op, numel, dtype in calls:
        if not runs or runs[-1][:3] != (group, op, dtype):
            runs.append((group, op, dtype, numel))
    if len(runs) != len(points):
        raise RuntimeError(f"bench {BENCH}: auto's probes ran {len(runs)} kinds of collective for {len(points)} probes")
    specs = dict(zip(points, runs))  # dict order is call order
    return points, specs


def _counters(iface: str) -> tuple[int, int]:
    stats = Path("/sys/class/net") / iface / "statistics"
    return int((stats / "tx_bytes").read_text()), int((stats / "rx_bytes").read_text())


def _slowest(rows: Sequence[tuple[float, float]]) -> tuple[list[float], list[float]]:
    """(bytes, seconds) of this rank -> bytes, each size's seconds on the slowest rank (as auto takes them)."""
    import torch
    import torch.distributed as dist

    seconds = torch.tensor([s for _, s in rows], dtype=torch.float64)
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    return [b for b, _ in rows], seconds.tolist()


def run_worker(out: Path, auto_repeats: int) -> None:
    """One rank: auto's probes, the larger ones, and the bytes each op sends over node 0's link; rank 0 writes
    {probe: [[bytes, s (slowest rank), link bytes sent per op, received per op], ...]} for auto's and the larger."""
    import torch
    import torch.distributed as dist

    from trainer.comm.auto import AutoCommunicator
    from trainer.dist import DistConfig, setup_distributed, teardown_distributed

    torch.set_num_threads(1)
    topo = setup_distributed(DistConfig(timeout_s=600))
    iface = os.environ.get("GLOO_SOCKET_IFNAME", "")
    try:
        repeats = []
        for _ in range(auto_repeats):  # each as auto runs it once at start-up: its spread is the fit's
            points, specs = auto_probes(topo)
            repeats.append({k: [[b, s] for b, s in zip(*_slowest(v))] for k, v in points.items()})
        timer = SimpleNamespace(topo=topo)
        result: dict[str, Any] = {"auto_repeats": repeats, "auto": {}, "large": {}}
        for name, (group_name, op, dtype, small) in specs.items():
            group = getattr(topo, group_name)
            run_op = {"allreduce": group.all_reduce_, "allgather": group.all_gather,
                      "reduce_scatter": group.reduce_scatter}[op]
            sizes = {"auto": [int(b) // torch.empty(0, dtype=dtype).element_size() for b, _ in points[name]],
                     "large": [small * s for s in SCALES]}
            for which, ns in sizes.items():
                rows = []
                for j, n in enumerate(ns):
                    t = torch.ones(n, dtype=dtype)
                    seconds = points[name][j][1] if which == "auto" else \
                        AutoCommunicator._timed(timer, lambda: run_op(t, name), reps=2)
                    reps = 1 if which == "large" else 8
                    dist.barrier()
                    before = _counters(iface) if topo.rank == 0 else (0, 0)
                    for _ in range(reps):
                        run_op(t, name)
                    dist.barrier()
                    after = _counters(iface) if topo.rank == 0 else (0, 0)
                    rows.append([float(n * t.element_size()), seconds, (after[0] - before[0]) / reps,
                                 (after[1] - before[1]) / reps])
                for r, s in zip(rows, _slowest([(r[0], r[1]) for r in rows])[1]):
                    r[1] = s
                result[which][name] = rows
            if topo.rank == 0:
                print(f"  {name}: " + ", ".join(f"{r[0] / 1e6:.3g} MB {r[1] * 1e3:.1f} ms"
                                                for w in ("auto", "large") for r in result[w][name]), flush=True)
        if topo.rank == 0:
            out.write_text(json.dumps(result))
        dist.barrier()
    finally:
        teardown_distributed()


# ---------------------------------------------------------------- fits and the table (pure)


def fit_links(points: Mapping[str, Sequence[Sequence[float]]], nodes: int = NODES, per_node: int = RANKS_PER_NODE
              ) -> dict[str, dict[str, float]]:
    """{link: {bytes_per_s, alpha_s}} fitted by build_network to {probe: [[bytes, s, ...], ...]}."""
    from trainer.comm.cost import Layout, build_network

    net = build_network(Layout(nodes, per_node), {k: [(r[0], r[1]) for r in rows] for k, rows in points.items()})
    return {k: {"bytes_per_s": v.bytes_per_s, "alpha_s": v.alpha_s} for k, v in net.links.items()}


def wire_share(points: Mapping[str, Sequence[Sequence[float]]], nodes: int = NODES, per_node: int = RANKS_PER_NODE
               ) -> dict[str, list[float]]:
    """Per crossing probe and size: the bytes node 0's link carried per op (sent), over the bytes the fitted
    formula puts through one link for it (1.0: the formula counts what the wire carries)."""
    from trainer.comm import links as L
    from trainer.comm.cost import CROSSING

    w = nodes * per_node
    formulas = {"world": (L.ring_allreduce_s, w, 1), "world16": (L.ring_allreduce_s, w, 1),
                "world_gather": (L.allgather_s, w, 1), "inter": (L.allgather_s, nodes, per_node)}
    out = {}
    for name, rows in points.items():
        if name in CROSSING and name in formulas:
            formula, p, sharing = formulas[name]
            volume = L.volume_of(formula, p) * sharing
            out[name] = [r[2] / (volume * r[0]) if len(r) > 2 and r[0] else float("nan") for r in rows]
    return out


def median_fit(fits: Sequence[Mapping[str, Mapping[str, float]]]) -> dict[str, dict[str, float]]:
    """Per link, the median bytes/s and latency of several fits."""
    return {k: {q: statistics.median(f[k][q] for f in fits) for q in ("bytes_per_s", "alpha_s")} for k in fits[0]}


def compare(fits: Mapping[str, Mapping[str, Mapping[str, float]]], tcp_bytes_per_s: float,
            repeats: Sequence[Mapping[str, Mapping[str, float]]] = (), tolerance: float = TOLERANCE
            ) -> list[dict[str, Any]]:
    """One row per fitted link that crosses nodes: its bytes/s from each set of points, over the plain TCP rate,
    and the range of the auto-size fits over `repeats`."""
    from trainer.comm.cost import CROSSING

    rows = []
    names = [n for n in CROSSING if any(n in f for f in fits.values())]
    for name in names:
        row: dict[str, Any] = {"link": name}
        for which, links in fits.items():
            if name in links:
                bw = links[name]["bytes_per_s"]
                row[which] = {"bytes_per_s": bw, "alpha_s": links[name]["alpha_s"], "ratio": bw / tcp_bytes_per_s,
                              "within": abs(bw / tcp_bytes_per_s - 1) <= tolerance}
        if repeats:
            ratios = [f[name]["bytes_per_s"] / tcp_bytes_per_s for f in repeats if name in f]
            row["auto_repeat_ratio_range"] = [min(ratios), max(ratios)]
        rows.append(row)
    return rows


def table_rows(per_rate: Mapping[str, Mapping[str, Any]]) -> list[list[Any]]:
    """The printed table: per rate and crossing link, the TCP rate and each fit's MB/s, ratio and verdict."""
    rows = []
    for rate, r in per_rate.items():
        tcp = r["tcp"]["one_way_bytes_per_s"]
        for c in r["links"]:
            cells = []
            for which in ("auto", "large", "all"):
                f = c.get(which)
                cells += ["-", "-"] if f is None else [f"{f['bytes_per_s'] / 1e6:.1f}",
                                                      f"{f['ratio']:.2f}{'' if f['within'] else ' !'}"]
            span = c.get("auto_repeat_ratio_range")
            rows.append([rate, c["link"], f"{tcp / 1e6:.1f}", *cells[:2],
                         "-" if span is None else f"{span[0]:.2f}-{span[1]:.2f}", *cells[2:]])
    return rows


def tcp_rows(per_rate: Mapping[str, Mapping[str, Any]]) -> list[list[Any]]:
    """Per rate: plain TCP MB/s one way, reverse, duplex, two flows, the messages alone and back to back, the RTT."""
    rows = []
    for rate, r in per_rate.items():
        t = r["tcp"]
        msgs = [f"{m[k] / 1e6:.1f}" for m in t["messages"].values() for k in ("alone_bytes_per_s",
                                                                           "back_to_back_bytes_per_s")]
        rows.append([rate, *(f"{t[k] / 1e6:.1f}" for k in ("one_way_bytes_per_s", "reverse_bytes_per_s",
                                                          "duplex_up_bytes_per_s", "duplex_down_bytes_per_s",
                                                          "two_flows_bytes_per_s")), *msgs,
                     f"{t['ping_rtt_s'] * 1e6:.0f}"])
    return rows


TCP_HEADERS = ["rate", "one way", "reverse", "duplex up", "duplex down", "two flows", "1 MB alone", "1 MB b2b",
               "64 KB alone", "64 KB b2b", "RTT us"]
TABLE_HEADERS = ["rate", "link", "TCP MB/s", "auto-size fit MB/s", "ratio", "ratio range", "large fit MB/s", "ratio",
                 "all-points fit MB/s", "ratio"]


# ---------------------------------------------------------------- the emulated cluster (parent side)


def _netem(script: str, *args: str) -> None:
    common.netem(script, *args, env=NETEM_ENV, bench=BENCH, quiet=True)


def _netns(node: int) -> list[str]:
    return ["ip", "netns", "exec", f"{NETEM_ENV['NETEM_PREFIX']}-n{node}"]


def _addr(node: int) -> str:
    return f"{NETEM_ENV['NETEM_SUBNET']}.{node + 1}"


def tcp_at(rate: str, quick: bool) -> dict[str, Any]:
    """Plain TCP from node 0 to node 1 of the cluster (up at `rate`)."""
    sustained = int(max(rate_bytes_per_s(rate) * 0.8, 40e6) * (0.5 if quick else 1.0))  # 100 MB at 1gbit
    module = [sys.executable, "-m", "scripts.bench.links"]
    server = subprocess.Popen([*_netns(1), *module, "--tcp-server", str(TCP_PORT)], cwd=common.REPO,
                              stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        if server.stdout.readline().strip() != "ready":
            raise SystemExit(f"bench {BENCH}: the TCP server in node 1 did not start")
        proc = subprocess.run([*_netns(0), *module, "--tcp-client", _addr(1), str(TCP_PORT), str(sustained),
                               str(2 if quick else 3)], cwd=common.REPO, capture_output=True, text=True, timeout=600)
        if proc.returncode:
            raise SystemExit(f"bench {BENCH}: the TCP client failed:\n{proc.stderr[-2000:]}")
        return json.loads(proc.stdout.strip().splitlines()[-1])
    finally:
        common.end_tree(server.pid)
        server.wait()


def collectives_at(rate: str, quick: bool) -> dict[str, Any]:
    """auto's probes and the larger ones on 2 x 2 ranks of the cluster (up at `rate`)."""
    with tempfile.TemporaryDirectory(prefix="links-") as tmp:
        out = Path(tmp) / "probes.json"
        common.netem("run.sh", "--nproc-per-node", str(RANKS_PER_NODE), "--port", str(PORT), "--threads", "1",
                     "-m", "scripts.bench.links", "--worker", str(out), *(["--quick"] if quick else []),
                     env={**NETEM_ENV, "PY": sys.executable}, bench=BENCH)
        return json.loads(out.read_text())


def measure_rate(rate: str, quick: bool) -> dict[str, Any]:
    """Everything at one rate, fitted and compared."""
    print(f"[{rate}] plain TCP node 0 -> node 1", flush=True)
    tcp = tcp_at(rate, quick)
    mb = {k: f"{v / 1e6:.1f}" for k, v in tcp.items() if k.endswith("bytes_per_s")}
    print(f"  one way {mb['one_way_bytes_per_s']} MB/s, duplex {mb['duplex_up_bytes_per_s']}/"
          f"{mb['duplex_down_bytes_per_s']} MB/s, two flows {mb['two_flows_bytes_per_s']} MB/s, "
          f"RTT {tcp['ping_rtt_s'] * 1e6:.0f} us", flush=True)
    print(f"[{rate}] gloo probes on {NODES} x {RANKS_PER_NODE} ranks", flush=True)
    probes = collectives_at(rate, quick)
    both = {k: probes["auto"][k] + probes["large"][k] for k in probes["auto"]}
    repeats = [fit_links(p) for p in probes["auto_repeats"]]
    fits = {"auto": median_fit(repeats), "large": fit_links(probes["large"]), "all": fit_links(both)}
    return {"nominal_bytes_per_s": rate_bytes_per_s(rate), "tcp": tcp, "probes": probes, "fits": fits,
            "wire_share": {k: wire_share(probes[k]) for k in ("auto", "large")},
            "auto_repeat_fits": repeats, "links": compare(fits, tcp["one_way_bytes_per_s"], repeats)}


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = common.bench_parser(BENCH, __doc__.splitlines()[0])
    parser.add_argument("--rates", nargs="+", default=list(RATES), help=f"shaped rates (default {' '.join(RATES)})")
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--tcp-server", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--tcp-client", nargs=4, metavar=("ADDR", "PORT", "BYTES", "REPEATS"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.tcp_server:
        serve(args.tcp_server)
        return {}
    if args.tcp_client:
        addr, port, n, repeats = args.tcp_client
        print(json.dumps(measure_tcp(addr, int(port), int(n), int(repeats))))
        return {}
    if args.worker:
        run_worker(args.worker, 3 if args.quick else 7)
        return {}
    for rate in args.rates:
        rate_bytes_per_s(rate)  # a bad rate fails before any cluster is up
    common.record_run(args)
    reason = common.netem_skip_reason()
    if reason:
        result = {"bench": BENCH, "baseline": "plain TCP", "skipped": reason, "ratio": None}
        print(f"bench {BENCH}: skipped: {reason}\n{json.dumps(result)}")
        return result
    print(f"# scripts/bench/links.py: {common.machine()['cpu']}, {NODES} emulated nodes, "
          f"{'quick' if args.quick else 'full'} size", flush=True)
    per_rate: dict[str, Any] = {}
    up = False
    try:
        for rate in args.rates:
            _netem("cluster.sh", "up", str(NODES), rate)
            up = True
            per_rate[rate] = measure_rate(rate, args.quick)
    finally:
        if up:
            _netem("cluster.sh", "down")
    print("plain TCP, MB/s (b2b: messages back to back)")
    print_table(TCP_HEADERS, tcp_rows(per_rate))
    print("wire bytes per op over the bytes the formula puts through one link, per crossing probe and size")
    print_table(["rate", "probe", "auto sizes", "large sizes"],
                [[rate, k, " ".join(f"{x:.3f}" for x in v), " ".join(f"{x:.3f}" for x in r["wire_share"]["large"][k])]
                 for rate, r in per_rate.items() for k, v in r["wire_share"]["auto"].items()])
    print_table(TABLE_HEADERS, table_rows(per_rate))
    print(f"ratio: fitted bytes/s over plain TCP one way; ! = off by more than {TOLERANCE:.0%}; auto-size = the probes "
          f"auto runs (median fit of repeats, and their range), large = x{SCALES[0]} and x{SCALES[1]} their size")
    first = per_rate[args.rates[0]]
    world = next(c for c in first["links"] if c["link"] == "world")
    return common.emit_result(BENCH, "plain TCP one way", world["auto"]["ratio"], rates=list(args.rates),
                              layout=f"{NODES}x{RANKS_PER_NODE}", tolerance=TOLERANCE, scales=list(SCALES),
                              per_rate=per_rate)


if __name__ == "__main__":
    main()
