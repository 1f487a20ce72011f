#!/usr/bin/env bash
# A throwaway single-host Ceph cluster with a RADOS Gateway (S3) for backstop's off-host
# replication tests: one monitor, one OSD on memstore (data in RAM), one radosgw on a loopback port,
# cephx on, no mgr (S3 does not need one). Everything lives in DIR: nothing is written to /etc/ceph,
# /var/lib/ceph or /var/log/ceph. Packages: scripts/setup-ceph.sh.
#
#   ceph-cluster.sh start DIR       DIR must be empty or absent; free loopback ports are chosen.
#                                   Prints KEY=VALUE lines: S3_ENDPOINT, S3_ACCESS_KEY,
#                                   S3_SECRET_KEY, S3_REGION, CEPH_CONF, RGW_PORT.
#                                   With CEPH_RGW_TLS_DIR=D (holding cert.pem, the server
#                                   certificate chain, and key.pem, its key) the gateway also
#                                   serves https on a second loopback port, and two more lines
#                                   are printed: S3_TLS_ENDPOINT=https://127.0.0.1:PORT and
#                                   RGW_TLS_PORT. The files are read where they are (keep D).
#   ceph-cluster.sh stop-rgw DIR    stops only the gateway (the tests' "gateway down").
#   ceph-cluster.sh start-rgw DIR   starts it again on the same port.
#   ceph-cluster.sh stop DIR        stops every daemon started from DIR, then deletes DIR.
#
# Facts this relies on (measured on Debian 12, Ceph 16.2.15):
# - `paxos propose interval = 0.01` takes the cold start from ~17 s to ~1 s: radosgw creates
#   its pools one monitor command at a time, each otherwise waiting for a 1 s proposal.
# - A port another cluster holds answers our readiness probe: the ports are checked free first
#   and our radosgw's pid must still be alive once the probe answers.
# - `mon data avail crit = 0`: the monitor refuses to start when its filesystem has less than
#   that percentage free (default 5, 1% seen refusing on a 95%-full build disk); this
#   monitor's data is a few MB, so only a truly full disk stops it.
# - Stop one daemon at a time, gateway then OSD then monitor (SIGTERM, then SIGKILL after
#   10 s); a signal goes only to a pid whose command line names DIR/ceph.conf.
# - The keys are read with `od` from /dev/urandom (a `tr | head` pipeline dies of SIGPIPE
#   under pipefail).
set -euo pipefail

die() { echo "ceph-cluster: error: $*" >&2; exit 1; }
log() { echo "ceph-cluster: $*" >&2; }

(($# == 2)) || die "usage: $0 start|stop|stop-rgw|start-rgw DIR"
cmd=$1
dir=$2
[[ $dir == /* ]] || dir=$PWD/$dir
conf=$dir/ceph.conf

port_busy() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

# Below the kernel's ephemeral range (32768-60999 by default): a port there may be the local end
# of some client's connection, or in TIME-WAIT, which no probe sees and which made the monitor's
# bind fail (EADDRINUSE) while other tests hammered a gateway.
free_port() {
	local p lo span
	lo=$(cut -f1 /proc/sys/net/ipv4/ip_local_port_range 2>/dev/null || echo 32768)
	span=$((lo - 20000 - 2))
	((span >= 1000)) || span=30000
	for _ in $(seq 200); do
		p=$((20000 + RANDOM % span))
		if ! port_busy "$p" && ! port_busy "$((p + 1))"; then
			echo "$p"
			return 0
		fi
	done
	die "no free loopback port pair found"
}

# The pid in DIR/run/NAME.pid if it is a live process started with our ceph.conf.
our_pid() {
	local pid
	pid=$(cat "$dir/run/$1.pid" 2>/dev/null) || return 0
	[[ -n $pid && -r /proc/$pid/cmdline ]] || return 0
	if tr '\0' ' ' <"/proc/$pid/cmdline" | grep -qF -- "$conf"; then echo "$pid"; fi
	return 0
}

stop_one() {
	local pid
	pid=$(our_pid "$1")
	[[ -n $pid ]] || return 0
	kill -TERM "$pid" 2>/dev/null || return 0
	for _ in $(seq 100); do
		kill -0 "$pid" 2>/dev/null || return 0
		sleep 0.1
	done
	log "$1 (pid $pid) ignored SIGTERM for 10 s: SIGKILL"
	kill -KILL "$pid" 2>/dev/null || true
}

wait_rgw() {
	local port=$1 pid
	for _ in $(seq $((${START_TIMEOUT:-120} * 5))); do
		pid=$(our_pid client.rgw.a)
		if [[ -n $pid ]] && curl -fs -o /dev/null "http://127.0.0.1:$port/"; then
			return 0
		fi
		sleep 0.2
	done
	die "radosgw did not answer on 127.0.0.1:$port (see $dir/log)"
}

case $cmd in
start)
	for tool in ceph-mon ceph-osd radosgw radosgw-admin ceph-authtool monmaptool ceph uuidgen curl od; do
		command -v "$tool" >/dev/null || die "$tool missing (scripts/setup-ceph.sh installs Ceph)"
	done
	if [[ -e $dir ]] && [[ -n $(ls -A "$dir") ]]; then die "$dir is not empty"; fi
	rgw_port=${RGW_PORT:-$(free_port)}
	mon_port=$((rgw_port + 1))
	port_busy "$rgw_port" && die "port $rgw_port is in use"
	port_busy "$mon_port" && die "port $mon_port is in use"
	# tcp_nodelay=1: without it beast holds the tail of every response past 64 KiB until the
	# client ACKs the head (Nagle against delayed ACK): a GET of a 30-180 KB object took 26-31 ms
	# instead of 0.8 ms, and a pull of 172 MB 22 s.
	frontends="beast endpoint=127.0.0.1:$rgw_port tcp_nodelay=1"
	tls_dir=${CEPH_RGW_TLS_DIR:-}
	if [[ -n $tls_dir ]]; then
		[[ $tls_dir == /* ]] || tls_dir=$PWD/$tls_dir
		[[ -r $tls_dir/cert.pem && -r $tls_dir/key.pem ]] ||
			die "CEPH_RGW_TLS_DIR=$tls_dir must hold cert.pem and key.pem"
		tls_port=$(free_port)
		while [[ $tls_port == "$rgw_port" || $tls_port == "$mon_port" ]]; do tls_port=$(free_port); done
		# beast (Ceph 16.2.15): ssl_endpoint beside the plain endpoint, one process.
		frontends+=" ssl_endpoint=127.0.0.1:$tls_port ssl_certificate=$tls_dir/cert.pem"
		frontends+=" ssl_private_key=$tls_dir/key.pem"
	fi
	mkdir -p "$dir"/{run,log,crash,mon.a,osd.0,rgw.a}
	chmod 0700 "$dir"
	fsid=$(uuidgen)
	cat >"$conf" <<CONF
[global]
fsid = $fsid
mon host = [v2:127.0.0.1:$mon_port]
keyring = $dir/keyring
run dir = $dir/run
admin socket = $dir/run/\$name.asok
pid file = $dir/run/\$name.pid
log file = $dir/log/\$name.log
mon cluster log file = $dir/log/cluster.log
crash dir = $dir/crash
log to stderr = false
err to stderr = true
osd pool default size = 1
osd pool default min size = 1
osd pool default pg num = 8
osd pool default pgp num = 8
osd pool default pg autoscale mode = off
osd crush chooseleaf type = 0
mon allow pool delete = true
mon warn on pool no redundancy = false
mon warn on insecure global id reclaim allowed = false
mon data avail warn = 2
mon data avail crit = 0

[mon]
mon data = $dir/\$name
paxos propose interval = 0.01

[osd]
osd data = $dir/\$name
osd objectstore = memstore
memstore device bytes = ${MEMSTORE_BYTES:-2147483648}
osd crush initial weight = 1
public addr = 127.0.0.1
cluster addr = 127.0.0.1

[client.rgw.a]
rgw data = $dir/rgw.a
rgw frontends = $frontends
CONF
	# One keyring for every entity: the monitor's mkfs imports them all.
	kr=$dir/keyring
	ceph-authtool --create-keyring "$kr" --gen-key -n mon. --cap mon 'allow *' >/dev/null
	ceph-authtool "$kr" --gen-key -n client.admin --cap mon 'allow *' --cap osd 'allow *' \
		--cap mgr 'allow *' >/dev/null
	ceph-authtool "$kr" --gen-key -n osd.0 --cap mon 'allow profile osd' --cap osd 'allow *' \
		--cap mgr 'allow profile osd' >/dev/null
	ceph-authtool "$kr" --gen-key -n client.rgw.a --cap mon 'allow rw' --cap osd 'allow rwx' \
		--cap mgr 'allow rw' >/dev/null
	monmaptool --create --fsid "$fsid" --addv a "[v2:127.0.0.1:$mon_port]" "$dir/monmap" >/dev/null
	ceph-mon -c "$conf" -i a --mkfs --monmap "$dir/monmap" --keyring "$kr"
	ceph-mon -c "$conf" -i a
	osd_uuid=$(uuidgen)
	ceph -c "$conf" osd new "$osd_uuid" >/dev/null
	ceph-osd -c "$conf" -i 0 --mkfs --osd-uuid "$osd_uuid" 2>/dev/null
	ceph-osd -c "$conf" -i 0 2>/dev/null
	radosgw -c "$conf" -n client.rgw.a
	wait_rgw "$rgw_port"
	if [[ -n $tls_dir ]]; then
		# The https side answers too (-k: the probe checks the listener, not the certificate).
		for _ in $(seq 100); do
			curl -fsk -o /dev/null "https://127.0.0.1:$tls_port/" && break
			sleep 0.1
		done
		curl -fsk -o /dev/null "https://127.0.0.1:$tls_port/" ||
			die "radosgw did not answer https on 127.0.0.1:$tls_port (see $dir/log)"
	fi
	access=$(od -An -N10 -tx1 /dev/urandom | tr -d ' \n')
	secret=$(od -An -N20 -tx1 /dev/urandom | tr -d ' \n')
	radosgw-admin -c "$conf" user create --uid=backstop --display-name="backstop tests" \
		--access-key="$access" --secret-key="$secret" >/dev/null
	echo "$rgw_port" >"$dir/rgw.port"
	echo "S3_ENDPOINT=http://127.0.0.1:$rgw_port"
	echo "S3_ACCESS_KEY=$access"
	echo "S3_SECRET_KEY=$secret"
	echo "S3_REGION=us-east-1"
	echo "CEPH_CONF=$conf"
	echo "RGW_PORT=$rgw_port"
	if [[ -n $tls_dir ]]; then
		echo "S3_TLS_ENDPOINT=https://127.0.0.1:$tls_port"
		echo "RGW_TLS_PORT=$tls_port"
	fi
	;;
stop-rgw)
	stop_one client.rgw.a
	;;
start-rgw)
	[[ -n $(our_pid client.rgw.a) ]] && exit 0
	radosgw -c "$conf" -n client.rgw.a
	wait_rgw "$(cat "$dir/rgw.port")"
	;;
stop)
	[[ -f $conf ]] || { rm -rf "$dir"; exit 0; }
	stop_one client.rgw.a
	stop_one osd.0
	stop_one mon.a
	rm -rf "$dir"
	;;
*) die "unknown command $cmd" ;;
esac
