"""The cost model's formulas (trainer/comm/cost.py, its links in trainer/comm/links.py) on hand-computed
cases: collective times, the exchanges' collectives, the bytes they send (the communicators' byte metrics),
the exposed time, the link fit, the network fitted to probes and the plan `choose` finds."""

from __future__ import annotations

import math

import pytest

from trainer.comm.cost import (DENSE, PROBES, Choice, Collective, Layout, Link, Network, Selection, allgather_s,
                               build_network, candidates, choose, describe, exchange_bytes, exposed_s, fit_link,
                               hierarchical_allreduce_s, k_of, reduce_scatter_s, ring_allreduce_s, sent_bytes,
                               with_inter_rate)

pytestmark = pytest.mark.unit

LINK = Link(alpha_s=1e-3, bytes_per_s=100e6)  # 1 ms per ring step, 100 MB/s


def test_ring_allreduce_hand_computed():
    # 4 ranks, 100 MB: 2*3 steps of 1 ms + 2*3/4 * 100 MB / 100 MB/s = 0.006 + 1.5 s
    assert ring_allreduce_s(100e6, 4, LINK) == pytest.approx(1.506)
    # 2 ranks: 2 steps + 1x the buffer
    assert ring_allreduce_s(50e6, 2, LINK) == pytest.approx(0.002 + 0.5)
    assert ring_allreduce_s(100e6, 1, LINK) == 0.0


def test_reduce_scatter_and_allgather_hand_computed():
    # reduce-scatter of 80 MB over 4 ranks: 3 steps + 3/4 of the buffer
    assert reduce_scatter_s(80e6, 4, LINK) == pytest.approx(0.003 + 0.6)
    # allgather of 10 MB payloads over 4 ranks: 3 steps + 3 payloads through each link
    assert allgather_s(10e6, 4, LINK) == pytest.approx(0.003 + 0.3)
    # two groups sharing the link carry twice the bytes, same number of steps
    assert allgather_s(10e6, 4, LINK, sharing=2) == pytest.approx(0.003 + 0.6)
    assert reduce_scatter_s(80e6, 1, LINK) == 0.0 and allgather_s(10e6, 1, LINK) == 0.0


def test_reduce_scatter_plus_allgather_is_an_allreduce():
    n, p = 64e6, 8
    assert reduce_scatter_s(n, p, LINK) + allgather_s(n / p, p, LINK) == pytest.approx(ring_allreduce_s(n, p, LINK))


def test_hierarchical_allreduce_hand_computed():
    intra, inter = Link(0.0, 1e9), Link(0.0, 1e8)
    # 2 nodes x 4 GPUs, 100 MB: intra RS 3/4*0.1 s, inter 2*1/2*1 s, intra AG 3*25 MB / 1 GB/s = 0.075 s
    assert hierarchical_allreduce_s(100e6, 2, 4, intra, inter) == pytest.approx(0.075 + 1.0 + 0.075)
    # one node: no inter-node part
    assert hierarchical_allreduce_s(100e6, 1, 4, intra, inter) == pytest.approx(0.15)


def test_describe_lists_each_exchanges_collectives():
    lay = Layout(2, 4)
    n = 10_000_001  # not a multiple of 4: the shard rounds up, k rounds up
    assert describe(n, Choice("dense"), lay).collectives == (Collective("allreduce", 4 * n, "world"),)
    assert describe(n, Choice("dense16"), lay).collectives == (Collective("allreduce", 2 * n, "world", 2),)
    topk = describe(n, Choice("topk", 0.01), lay)
    assert topk.k == 100_001 and topk.select_elements == n
    assert topk.collectives == (Collective("allgather", 8 * 100_001, "world"),)
    hi = describe(n, Choice("hitopk", 0.01), lay)
    shard = 2_500_001
    assert hi.select_elements == shard and hi.k == k_of(shard, 0.01) == 25_001
    assert hi.collectives == (Collective("reduce_scatter", 4 * shard * 4, "intra"),
                              Collective("allgather", 8 * 25_001, "inter"), Collective("allgather", 4 * shard, "intra"))
    assert describe(n, Choice("hitopk", 0.01), Layout(4, 1)) == describe(n, Choice("topk", 0.01), Layout(4, 1))
    assert describe(n, Choice("topk", 0.01), Layout(1, 1)).collectives == ()


def test_sent_bytes_count_the_node_crossing_hops_of_a_node_major_ring():
    two_by_two, four_by_one, one_node = Layout(2, 2), Layout(4, 1), Layout(1, 4)
    # allreduce of 400 bytes over 4 ranks: 2*3/4 of the buffer; 2 of the ring's 4 hops cross nodes
    assert sent_bytes(Collective("allreduce", 400, "world"), two_by_two) == pytest.approx((600, 300))
    # allgather of 80-byte payloads over 4 ranks: 3 payloads; the same ring, half of them between nodes
    assert sent_bytes(Collective("allgather", 80, "world"), two_by_two) == pytest.approx((240, 120))
    # every hop crosses nodes on 1-rank nodes; none on one node
    assert sent_bytes(Collective("allgather", 80, "world"), four_by_one) == pytest.approx((240, 240))
    assert sent_bytes(Collective("allgather", 80, "world"), one_node) == pytest.approx((240, 0))
    # among the nodes' ranks of one local rank: all inter-node; inside a node: none
    assert sent_bytes(Collective("allgather", 80, "inter"), two_by_two) == pytest.approx((80, 80))
    assert sent_bytes(Collective("reduce_scatter", 400, "intra"), two_by_two) == pytest.approx((200, 0))
    # hitopk of 1000 elements at 1% on 2x2: shard 500, k 5; RS of 4000 B sends half, the inter-node AG one
    # 40-byte payload, the intra-node AG one 2000-byte shard
    assert exchange_bytes(describe(1000, Choice("hitopk", 0.01), two_by_two), two_by_two) == pytest.approx(
        (2000 + 40 + 2000, 40))


def test_network_times_a_hitopk_chain_on_a_gpu_cluster():
    lay = Layout(2, 4)
    intra, inter = Link(0.0, 1e9), Link(0.0, 1e8)
    net = Network(lay, {"world": inter, "inter": inter, "intra": intra}, Selection(1e-3, 1e-9),
                  dense_algorithm="hierarchical")
    n = 10_000_000  # 40 MB of fp32
    assert net.chain_s(describe(n, Choice("dense"), lay)) == pytest.approx(
        hierarchical_allreduce_s(40e6, 2, 4, intra, inter))
    # hitopk at 1%: shard 2.5 M, k 25,000 pairs of 8 bytes; the 4 local ranks share the NIC; selection on the shard
    expected = (reduce_scatter_s(40e6, 4, intra) + allgather_s(8 * 25_000, 2, inter, sharing=4)
                + allgather_s(10e6, 4, intra) + 1e-3 + 1e-9 * 2_500_000)
    assert net.chain_s(describe(n, Choice("hitopk", 0.01), lay)) == pytest.approx(expected)
    # flat topk: 100,000 pairs through one ring of all 8 ranks
    assert net.network_s(describe(n, Choice("topk", 0.01), lay)) == pytest.approx(allgather_s(800_000, 8, inter))


def test_exposed_time_hand_computed():
    # backward 2 s; two buckets ready 1.5 s and 0 s before its end
    ready = [1.5, 0.0]
    assert exposed_s(ready, [0.1, 0.1]) == pytest.approx(0.1)  # only the last chain shows
    # a long first chain: from 1.5 s before the end, 3 s long; the second waits for it
    assert exposed_s(ready, [3.0, 0.5]) == pytest.approx(1.5 + 0.5)
    # local work competing with backward bounds it from below; a chain hidden entirely shows nothing
    assert exposed_s(ready, [0.1, 0.1], cpu_s=0.4) == pytest.approx(0.4)
    assert exposed_s([1.5], [0.5]) == 0.0


def test_fit_link_recovers_alpha_and_bandwidth():
    link, w = Link(2e-3, 50e6), 4
    points = [(4 * n, ring_allreduce_s(4 * n, w, link)) for n in (1e5, 1e6, 4e6)]
    fitted = fit_link(points, 2 * (w - 1), 2 * (w - 1) / w)
    assert fitted.alpha_s == pytest.approx(2e-3)
    assert fitted.bytes_per_s == pytest.approx(50e6)


def test_fit_link_survives_a_larger_probe_measured_faster():
    noisy = fit_link([(1e4, 0.02), (1e6, 0.01)], 6, 1.5)  # noise hid the growth with size
    assert noisy.alpha_s == 0 and math.isclose(noisy.bytes_per_s, 1.5e6 / 0.01)


def test_build_network_gives_back_the_links_that_timed_its_probes():
    lay, per = Layout(2, 2), 2
    world, wire16, inter, intra = Link(3e-5, 2e9), Link(1e-5, 4e9), Link(8e-5, 3e8), Link(2e-6, 8e9)
    probes = {"world": [(b, ring_allreduce_s(b, 4, world)) for b in (2.0**15, 2.0**19)],
              "world16": [(b, ring_allreduce_s(b, 4, wire16)) for b in (2.0**15, 2.0**19)],
              "inter": [(b, allgather_s(b, 2, inter, sharing=per)) for b in (2.0**13, 2.0**17)],
              "intra_gather": [(b, allgather_s(b, per, intra)) for b in (2.0**15, 2.0**19)],
              "intra_scatter": [(b, reduce_scatter_s(b, per, intra)) for b in (2.0**16, 2.0**20)]}
    assert set(probes) <= set(PROBES)
    net = build_network(lay, probes, [(1e6, 0.011), (2e6, 0.021)])
    for name, link in {"world": world, "inter": inter, "intra": intra}.items():
        assert net.links[name].alpha_s == pytest.approx(link.alpha_s, rel=1e-6), name
        assert net.links[name].bytes_per_s == pytest.approx(link.bytes_per_s, rel=1e-6), name
    assert net.links["world16"] == net.links["world"]  # a 16-bit wire is never faster per byte than fp32's
    assert net.selection.fixed_s == pytest.approx(1e-3) and net.selection.per_element_s == pytest.approx(1e-8)


def test_a_bucket_that_hides_behind_backward_stays_dense_and_the_safe_density_bounds_the_choice():
    lay = Layout(2, 2)
    slow = Link(1e-4, 10e6)
    net = Network(lay, {"world": slow, "world16": slow, "world_gather": slow, "inter": slow,
                        "intra": Link(1e-5, 5e9)}, Selection(1e-4, 2e-9))
    sizes = [6_000_000, 6_000_000]
    opts = lambda i: candidates(sizes[i], lay, [0.01, 0.001], 0.01, 16384)  # noqa: E731
    assert all(c.density >= 0.01 for c in opts(0))
    # bucket 0 is ready long before backward ends (its dense exchange hides), bucket 1 at the very end
    plan, t = choose(sizes, [100.0, 0.0], net, opts, local_competes=False)
    assert plan[0] == DENSE and plan[1].sparse
    _, all_dense = choose(sizes, [100.0, 0.0], net, lambda i: [DENSE], local_competes=False)
    assert t < all_dense
    assert math.isfinite(t)


def test_many_small_buckets_move_together_when_no_single_move_clears_the_margin():
    # 50 buckets ready at the end of backward: each one's 16-bit wire saves ~1% of the exposed time, below the
    # per-move margin, but all of them together halve it
    lay = Layout(2, 2)
    link = Link(1e-5, 1e9)
    net = Network(lay, {"world": link, "world16": link, "intra": Link(1e-6, 1e10)})
    sizes = [250_000] * 50
    opts = lambda i: [DENSE, Choice("dense16")]  # noqa: E731
    plan, t = choose(sizes, [0.0] * 50, net, opts, local_competes=False)
    assert plan == [Choice("dense16")] * 50, plan
    _, all_dense = choose(sizes, [0.0] * 50, net, lambda i: [DENSE], local_competes=False)
    assert t < 0.6 * all_dense
    # with nothing to gain the uniform starts do not win: ties stay dense
    same = Network(lay, {"world": link, "world16": Link(1e-5, 0.5e9), "intra": Link(1e-6, 1e10)})
    plan, _ = choose(sizes, [0.0] * 50, same, opts, local_competes=False)
    assert plan == [DENSE] * 50


def test_a_link_scales_with_the_network_down_to_the_hosts_floor():
    """The 2x2 emulated cluster's links as calibrated at 1 Gbit/s (world 123 MB/s, the ranks of one node 243 MB/s):
    at a fifth of the rate the world ring carries a fifth of the bytes per second (its calibration at 200 Mbit/s
    fitted 23 MB/s), not the 41 MB/s of a host share added to the wire's; five times faster, the hosts' 243 MB/s
    bounds it. A link calibrated faster than the hosts (an unshaped run) does not speed up, and slows down as a
    wire; with no node-local link (one rank per node) nothing bounds it. Catches host work added in series with
    the wire, a floor above a link that already beat it, and a floor made up where nothing measured one."""
    mb = 1e6
    links = {"world": Link(8e-4, 123 * mb), "world16": Link(8e-4, 100 * mb), "world_gather": Link(6e-4, 1274 * mb),
             "intra": Link(2e-3, 243 * mb)}
    net = Network(Layout(2, 2), links)
    slow, fast = with_inter_rate(net, 0.2), with_inter_rate(net, 5.0)
    assert slow.links["world"].bytes_per_s == pytest.approx(123 * mb / 5)
    assert fast.links["world"].bytes_per_s == pytest.approx(243 * mb)
    assert slow.links["world16"].bytes_per_s == pytest.approx(100 * mb / 5)  # a 16-bit wire is a wire
    assert fast.links["world_gather"].bytes_per_s == pytest.approx(1274 * mb)
    assert slow.links["world_gather"].bytes_per_s == pytest.approx(1274 * mb / 5)
    assert slow.links["intra"] == fast.links["intra"] == links["intra"]  # a node's own link is not the network's
    assert slow.links["world"].alpha_s == links["world"].alpha_s
    one_per_node = Network(Layout(4, 1), {"world": Link(8e-4, 123 * mb)})
    assert with_inter_rate(one_per_node, 5.0).links["world"].bytes_per_s == pytest.approx(5 * 123 * mb)
