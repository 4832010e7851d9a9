#!/usr/bin/env bash
# An emulated public-cloud cluster on one machine: N network namespaces ("nodes"), each joined to one
# bridge (the "switch") by a veth pair whose two directions are shaped to RATE with tc tbf. Traffic
# between ranks of one node stays on that namespace's loopback (fast, like NVLink/PCIe inside a node);
# traffic between nodes crosses the node's uplink (shaped on the way out) and the other node's downlink
# (shaped on the way in), like a cloud NIC of RATE in each direction. netem (delay, loss) is not in
# every kernel; bandwidth is the quantity the paper's argument is about, and tbf shapes it.
#
#   scripts/netem/cluster.sh up N RATE     create (or reshape) nodes 0..N-1; RATE: 1gbit, 200mbit, unlimited
#   scripts/netem/cluster.sh rate RATE     reshape every node's links to RATE while the cluster is up (runs go on)
#   scripts/netem/cluster.sh down          remove every namespace, veth, bridge and qdisc it made
#   scripts/netem/cluster.sh status        nodes, addresses and shaping
#   scripts/netem/cluster.sh addr I        the address of node I (for MASTER_ADDR)
#
# Node i is namespace ${NETEM_PREFIX}-n<i> with interface ${NETEM_PREFIX}-v<i> at ${NETEM_SUBNET}.<i+1>/24.
# Defaults: NETEM_PREFIX=dawn, NETEM_SUBNET=10.213.0 (private). Needs root, ip and tc (iproute2; installed
# with apt-get when absent and possible).
set -euo pipefail

PREFIX=${NETEM_PREFIX:-dawn}
SUBNET=${NETEM_SUBNET:-10.213.0}
BRIDGE="${PREFIX}-br"
MAX_NODES=64

die() { echo "cluster.sh: $*" >&2; exit 1; }
usage() { sed -n '9,13p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }

check_prefix() {
  [[ $PREFIX =~ ^[a-z][a-z0-9]{0,5}$ ]] || die "NETEM_PREFIX must be 1-6 lowercase letters/digits starting with a letter, got '$PREFIX'"
  [[ $SUBNET =~ ^(10|192\.168|172\.(1[6-9]|2[0-9]|3[01]))(\.[0-9]{1,3}){1,2}$ ]] && [[ $(tr -cd . <<<"$SUBNET") == ".." ]] \
    || die "NETEM_SUBNET must be the first three octets of a private /24 (e.g. 10.213.0), got '$SUBNET'"
}

need_root_and_tools() {
  [[ $(id -u) -eq 0 ]] || die "must run as root (network namespaces and tc need CAP_NET_ADMIN); try: sudo $0 $*"
  if ! command -v ip >/dev/null || ! command -v tc >/dev/null; then
    if command -v apt-get >/dev/null; then
      echo "cluster.sh: ip/tc missing; installing iproute2 with apt-get" >&2
      DEBIAN_FRONTEND=noninteractive apt-get install -y -qq iproute2 >&2 \
        || { apt-get update -qq >&2 && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq iproute2 >&2; } \
        || die "ip/tc missing and 'apt-get install iproute2' failed; install iproute2 by hand"
    fi
    command -v ip >/dev/null && command -v tc >/dev/null || die "ip and tc (package iproute2) are required and missing"
  fi
}

# tc rate -> bits per second (accepts bit, kbit, mbit, gbit; case-insensitive; decimals allowed)
rate_bps() {
  local r=${1,,}
  [[ $r =~ ^([0-9]+(\.[0-9]+)?)(bit|kbit|mbit|gbit)$ ]] \
    || die "RATE must look like 1gbit, 200mbit or 500kbit (or 'unlimited'), got '$1'"
  local mult=1
  case ${BASH_REMATCH[3]} in kbit) mult=1000 ;; mbit) mult=1000000 ;; gbit) mult=1000000000 ;; esac
  # %.0f, not %d: mawk's %d stops at 2^31-1, which would shape 5gbit to 2147mbit
  awk -v v="${BASH_REMATCH[1]}" -v m="$mult" 'BEGIN { printf "%.0f", v * m }'
}

nodes_present() {  # indices of this prefix's namespaces, sorted
  ip netns list 2>/dev/null | awk '{print $1}' | sed -n "s/^${PREFIX}-n\([0-9]\{1,\}\)\$/\1/p" | sort -n
}

# Shape one device's egress: tbf with a burst of ~2 ms at RATE (>= 64 KiB so that segmentation offload
# packets pass whole) and a queue of ~50 ms (a cloud switch buffers; a tiny queue would make TCP collapse).
shape() {  # shape NETNS_OR_EMPTY DEV BPS
  local ns=$1 dev=$2 bps=$3 run=()
  [[ -n $ns ]] && run=(ip netns exec "$ns")
  if [[ $bps -eq 0 ]]; then
    "${run[@]}" tc qdisc del dev "$dev" root 2>/dev/null || true
    return
  fi
  local burst=$(( bps / 8 / 500 )) limit=$(( bps / 8 / 20 ))
  (( burst < 65536 )) && burst=65536
  (( limit < 4 * burst )) && limit=$(( 4 * burst ))
  "${run[@]}" tc qdisc replace dev "$dev" root tbf rate "${bps}bit" burst "$burst" limit "$limit"
}

cmd_up() {
  local n=${1:-} rate=${2:-}
  [[ $n =~ ^[0-9]+$ ]] && (( n >= 1 && n <= MAX_NODES )) || die "up: N must be an integer in 1..$MAX_NODES, got '${n}'"
  [[ -n $rate ]] || die "up: RATE missing (e.g. scripts/netem/cluster.sh up $n 1gbit)"
  local bps=0
  [[ ${rate,,} == unlimited ]] || bps=$(rate_bps "$rate")
  if ! ip link show "$BRIDGE" >/dev/null 2>&1; then
    ip link add "$BRIDGE" type bridge
  fi
  ip link set "$BRIDGE" up
  local i
  for i in $(nodes_present); do  # fewer nodes than before: remove the extra ones
    (( i >= n )) && remove_node "$i"
  done
  for (( i = 0; i < n; i++ )); do
    local ns="${PREFIX}-n$i" v="${PREFIX}-v$i" h="${PREFIX}-h$i"
    if ! ip netns list | awk '{print $1}' | grep -qx "$ns"; then
      ip link del "$h" 2>/dev/null || true  # a half-made node from an interrupted run
      ip netns add "$ns"
      ip link add "$v" type veth peer name "$h"
      ip link set "$v" netns "$ns"
      ip link set "$h" master "$BRIDGE"
      ip link set "$h" up
      ip -n "$ns" addr add "$SUBNET.$(( i + 1 ))/24" dev "$v"
      ip -n "$ns" link set "$v" up
      ip -n "$ns" link set lo up  # ranks of one node talk over loopback (unshaped)
    fi
    write_etc "$n" "$i"
    shape "$ns" "$v" "$bps"   # node -> switch (upload)
    shape "" "$h" "$bps"      # switch -> node (download)
  done
  cmd_status
}

# Per-namespace /etc/hosts naming every node, and an empty resolv.conf (`ip netns exec` bind-mounts
# /etc/netns/NS/* over /etc): c10d looks up peer names, and a DNS server unreachable from inside the
# namespace would make every lookup wait and warn.
write_etc() {  # write_etc N I
  local n=$1 i=$2 j dir="/etc/netns/${PREFIX}-n$2"
  mkdir -p "$dir"
  {
    echo "# written by scripts/netem/cluster.sh; removed by its 'down'"
    echo "127.0.0.1 localhost"
    echo "::1 localhost"
    echo "::ffff:127.0.0.1 localhost"
    for (( j = 0; j < n; j++ )); do  # c10d's store sees IPv4 peers as IPv4-mapped IPv6 addresses
      echo "$SUBNET.$(( j + 1 )) ${PREFIX}-n$j"
      echo "::ffff:$SUBNET.$(( j + 1 )) ${PREFIX}-n$j"
    done
  } >"$dir/hosts"
  echo "# written by scripts/netem/cluster.sh: no DNS inside the emulated cluster" >"$dir/resolv.conf"
}

remove_node() {
  local i=$1
  ip netns del "${PREFIX}-n$i" 2>/dev/null || true  # takes its veth end, and so the pair, with it
  ip link del "${PREFIX}-h$i" 2>/dev/null || true
  rm -rf "/etc/netns/${PREFIX}-n$i"
}

# A link that degrades (or recovers) mid-run: the same nodes, new shaping, live connections untouched.
cmd_rate() {
  local rate=${1:-}
  [[ -n $rate ]] || die "rate: RATE missing (e.g. scripts/netem/cluster.sh rate 200mbit)"
  local bps=0
  [[ ${rate,,} == unlimited ]] || bps=$(rate_bps "$rate")
  local nodes i
  nodes=$(nodes_present)
  [[ -n $nodes ]] || die "rate: no nodes (prefix $PREFIX): run scripts/netem/cluster.sh up N RATE first"
  for i in $nodes; do
    shape "${PREFIX}-n$i" "${PREFIX}-v$i" "$bps"   # node -> switch (upload)
    shape "" "${PREFIX}-h$i" "$bps"                # switch -> node (download)
  done
  cmd_status
}

cmd_down() {
  local i
  for i in $(nodes_present); do
    remove_node "$i"
  done
  # host-side veth ends left by an interrupted up (their namespace was never made)
  for dev in $(ip -o link show 2>/dev/null | awk -F': ' '{print $2}' | sed 's/@.*//' | grep -E "^${PREFIX}-h[0-9]+$" || true); do
    ip link del "$dev" 2>/dev/null || true
  done
  ip link del "$BRIDGE" 2>/dev/null || true
  rmdir /etc/netns 2>/dev/null || true  # only if empty: other namespaces' files stay
  echo "cluster.sh: down (prefix $PREFIX): no namespace, veth or bridge of this cluster is left"
}

cmd_status() {
  local nodes
  nodes=$(nodes_present)
  if [[ -z $nodes ]]; then
    echo "cluster.sh: no nodes (prefix $PREFIX)"
    return 0
  fi
  printf '%-6s %-12s %-16s %-14s %s\n' node namespace address uplink downlink
  local i
  for i in $nodes; do
    local ns="${PREFIX}-n$i"
    local addr up down
    addr=$(ip -n "$ns" -4 -o addr show dev "${PREFIX}-v$i" 2>/dev/null | awk '{print $4}')
    up=$(ip netns exec "$ns" tc qdisc show dev "${PREFIX}-v$i" 2>/dev/null | awk '/tbf/ {for (j=1;j<=NF;j++) if ($j=="rate") print $(j+1)}')
    down=$(tc qdisc show dev "${PREFIX}-h$i" 2>/dev/null | awk '/tbf/ {for (j=1;j<=NF;j++) if ($j=="rate") print $(j+1)}')
    printf '%-6s %-12s %-16s %-14s %s\n' "$i" "$ns" "${addr:-?}" "${up:-unlimited}" "${down:-unlimited}"
  done
}

main() {
  local cmd=${1:-}
  [[ -n $cmd ]] || usage
  shift
  check_prefix
  case $cmd in
    up) need_root_and_tools "$cmd" "$@"; cmd_up "$@" ;;
    rate) need_root_and_tools "$cmd" "$@"; cmd_rate "$@" ;;
    down) need_root_and_tools "$cmd" "$@"; cmd_down ;;
    status) need_root_and_tools "$cmd" "$@"; cmd_status ;;
    addr)
      [[ ${1:-} =~ ^[0-9]+$ ]] || die "addr: node index missing (scripts/netem/cluster.sh addr 0)"
      echo "$SUBNET.$(( $1 + 1 ))" ;;
    -h|--help|help) usage ;;
    *) die "unknown command '$cmd' (up, rate, down, status, addr)" ;;
  esac
}

main "$@"
