"""The links bench (scripts/bench/links.py): its pure parts without namespaces (rates, the fits on synthetic points,
the wire-byte share, the comparison and tables, which probes auto runs, the TCP client and server over loopback);
as root, one quick rate whose sustained plain TCP stays within 15% of the shaped rate."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from scripts.bench import links
from trainer.comm import links as L

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parent.parent
LINK = L.Link(alpha_s=50e-6, bytes_per_s=120e6)


def ring_points(sizes: list[int], formula, p: int, sharing: int = 1) -> list[list[float]]:
    """Synthetic [bytes, seconds, wire bytes sent, received] of a collective on LINK, the wire carrying exactly what
    the formula counts."""
    volume = L.volume_of(formula, p) * sharing
    return [[float(b), formula(float(b), p, LINK) if sharing == 1 else L.allgather_s(float(b), p, LINK, sharing),
             volume * b, volume * b] for b in sizes]


def synthetic_probes() -> dict[str, list[list[float]]]:
    return {"world": ring_points([2**15, 2**19], L.ring_allreduce_s, 4),
            "world16": ring_points([2**14, 2**18], L.ring_allreduce_s, 4),
            "world_gather": ring_points([2**13, 2**17], L.allgather_s, 4),
            "inter": ring_points([2**13, 2**17], L.allgather_s, 2, sharing=2),
            "intra_gather": [[float(b), L.allgather_s(b, 2, LINK)] for b in (2**15, 2**19)],
            "intra_scatter": [[float(b), L.reduce_scatter_s(b, 2, LINK)] for b in (2**16, 2**20)]}


def test_rates_parse_like_tc_and_a_bad_one_is_named():
    assert links.rate_bytes_per_s("1gbit") == 125e6
    assert links.rate_bytes_per_s("200mbit") == 25e6
    assert links.rate_bytes_per_s("500KBIT") == 62500.0
    with pytest.raises(ValueError, match="'fast'"):
        links.rate_bytes_per_s("fast")


def test_fit_recovers_the_link_from_points_that_follow_the_formulas():
    """Catches a fit that counts the bytes of a probe other than its formula does (the sharing of the inter probe,
    the 2(p-1)/p of a ring allreduce)."""
    fits = links.fit_links(synthetic_probes())
    for name in ("world", "world16", "world_gather", "inter", "intra"):
        assert fits[name]["bytes_per_s"] == pytest.approx(LINK.bytes_per_s, rel=1e-6), name
        assert fits[name]["alpha_s"] == pytest.approx(LINK.alpha_s, rel=1e-6), name


def test_wire_share_is_one_when_the_wire_carries_what_the_formula_counts():
    share = links.wire_share(synthetic_probes())
    assert set(share) == {"world", "world16", "world_gather", "inter"}  # the crossing probes only
    assert all(x == pytest.approx(1.0) for xs in share.values() for x in xs)
    doubled = {"world": [[r[0], r[1], 2 * r[2], r[3]] for r in synthetic_probes()["world"]]}
    assert links.wire_share(doubled)["world"] == [pytest.approx(2.0)] * 2


def test_compare_rates_each_crossing_link_against_tcp_and_flags_more_than_ten_percent():
    fit = {"world": {"bytes_per_s": 108e6, "alpha_s": 0.0}, "inter": {"bytes_per_s": 280e6, "alpha_s": 0.0},
           "intra": {"bytes_per_s": 1e9, "alpha_s": 0.0}}
    repeats = [fit, {**fit, "world": {"bytes_per_s": 240e6, "alpha_s": 0.0}}]
    rows = links.compare({"auto": links.median_fit(repeats), "large": fit}, 120e6, repeats)
    assert [r["link"] for r in rows] == ["world", "inter"]  # intra does not cross nodes: no TCP to compare with
    world = rows[0]
    assert world["large"]["ratio"] == pytest.approx(0.9) and world["large"]["within"]
    assert world["auto"]["bytes_per_s"] == pytest.approx(174e6) and not world["auto"]["within"]
    assert world["auto_repeat_ratio_range"] == [pytest.approx(0.9), pytest.approx(2.0)]
    assert not rows[1]["large"]["within"]
    table = links.table_rows({"1gbit": {"tcp": {"one_way_bytes_per_s": 120e6}, "links": rows}})
    assert len(table[0]) == len(links.TABLE_HEADERS)
    assert table[0][:6] == ["1gbit", "world", "120.0", "174.0", "1.45 !", "0.90-2.00"]
    assert table[1][-1] == "-"  # no all-points fit given


class FakeGroup:
    """A group that runs its collectives on one process (sizes as the real ones)."""

    def __init__(self, size: int) -> None:
        self.size = size

    def all_reduce_(self, t: torch.Tensor, what: str) -> torch.Tensor:
        return t

    def all_gather(self, t: torch.Tensor, what: str) -> torch.Tensor:
        return t.repeat(self.size)

    def reduce_scatter(self, t: torch.Tensor, what: str) -> torch.Tensor:
        return t[: t.numel() // self.size].clone()


def test_auto_probes_are_auto_own_groups_ops_and_sizes():
    """Catches a bench that times other collectives than auto's calibration (the larger probes repeat these)."""
    topo = SimpleNamespace(device=torch.device("cpu"), num_nodes=2, ranks_per_node=2, world=FakeGroup(4),
                           intra_node=FakeGroup(2), inter_node=FakeGroup(2))
    points, specs = links.auto_probes(topo)
    assert list(points) == list(specs)
    assert specs["world"] == ("world", "allreduce", torch.float32, 2**13)
    assert specs["world16"][:3] == ("world", "allreduce", torch.bfloat16)
    assert specs["world_gather"][:2] == ("world", "allgather")
    assert specs["inter"][:2] == ("inter_node", "allgather")
    assert specs["intra_scatter"][:2] == ("intra_node", "reduce_scatter")
    assert all(len(rows) == 2 and rows[0][0] < rows[1][0] for rows in points.values())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_tcp_client_and_server_measure_every_figure_over_loopback(monkeypatch):
    monkeypatch.setattr(links, "MESSAGES", (2**16,))
    monkeypatch.setattr(links, "PAUSE_S", 0.0)
    port = free_port()
    threading.Thread(target=links.serve, args=(port,), daemon=True).start()
    for _ in range(100):  # until it listens
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            threading.Event().wait(0.02)
    out = links.measure_tcp("127.0.0.1", port, 2**20, repeats=1)
    rates = [out[k] for k in ("one_way_bytes_per_s", "reverse_bytes_per_s", "duplex_up_bytes_per_s",
                              "duplex_down_bytes_per_s", "two_flows_bytes_per_s")]
    assert all(r > 0 for r in rates)
    msg = out["messages"][str(2**16)]
    assert msg["alone_s"] > 0 and msg["back_to_back"] >= 8 and msg["back_to_back_bytes_per_s"] > 0
    assert 0 < out["ping_rtt_s"] < 1


needs_root = pytest.mark.skipif(
    not hasattr(os, "geteuid") or os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("tc"),
    reason="needs root and iproute2 (ip, tc): network namespaces and tc shaping")


@pytest.mark.cluster
@needs_root
@pytest.mark.timeout(900)
def test_quick_bench_at_one_gigabit_sees_the_shaped_rate(tmp_path):
    """The emulated link carries plain TCP within 15% of its nominal rate, and the bench fits every crossing link."""
    proc = subprocess.run([sys.executable, "-m", "scripts.bench.links", "--quick", "--rates", "1gbit",
                           "--results-dir", str(tmp_path)], cwd=ROOT, text=True, capture_output=True, timeout=850)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    r = result["per_rate"]["1gbit"]
    assert r["tcp"]["one_way_bytes_per_s"] == pytest.approx(125e6, rel=0.15)
    assert {c["link"] for c in r["links"]} == {"world", "world16", "world_gather", "inter"}
    assert (tmp_path / "links.quick.json").is_file()


def test_results_table_renders_each_rate_and_link():
    from scripts import results_tables

    fit = {"world": {"bytes_per_s": 240e6, "alpha_s": 0.0}}
    tcp = {"one_way_bytes_per_s": 120e6, "duplex_up_bytes_per_s": 119e6, "duplex_down_bytes_per_s": 118e6,
           "two_flows_bytes_per_s": 120e6, "ping_rtt_s": 4e-5,
           "messages": {"1048576": {"alone_bytes_per_s": 150e6, "back_to_back_bytes_per_s": 120e6}}}
    result = {"layout": "2x2", "tolerance": 0.1, "scales": [128, 512],
              "per_rate": {"1gbit": {"tcp": tcp, "links": links.compare({"auto": fit}, 120e6, [fit])}}}
    text = "\n".join(results_tables.links(result))
    assert "| 1gbit | 120.0 | 119.0 | 118.0 | 120.0 | 150.0 / 120.0 | 40 |" in text
    assert "| 1gbit | world | 120.0 | 240.0 (2.00x, off) | 2.00-2.00 | - | - |" in text
    assert "1 MB alone / back to back" in text and "x128 and x512" in text
