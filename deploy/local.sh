#!/usr/bin/env bash
# A local etcd for running workers by hand (127.0.0.1 only). Prints its URL; Ctrl-C stops it.
#   deploy/local.sh [CLIENT_PORT] [DATA_DIR]
#   then, for example:
#   mesh prefill --checkpoint DIR --pp-size 2 --etcd http://127.0.0.1:2379 &
#   mesh decode  --checkpoint DIR --tp-size 2 --etcd http://127.0.0.1:2379 &
#   mesh serve   --port 8000 --etcd http://127.0.0.1:2379
set -euo pipefail
port="${1:-2379}"
peer=$((port + 1))
data="${2:-.run/etcd-local}"
command -v etcd >/dev/null || { echo "etcd is not installed (Debian: apt-get install etcd-server)" >&2; exit 1; }
mkdir -p "$data" && chmod 700 "$data"
echo "etcd at http://127.0.0.1:${port} (data in ${data})"
exec etcd --name local --data-dir "$data" \
  --listen-client-urls "http://127.0.0.1:${port}" --advertise-client-urls "http://127.0.0.1:${port}" \
  --listen-peer-urls "http://127.0.0.1:${peer}" --initial-advertise-peer-urls "http://127.0.0.1:${peer}" \
  --initial-cluster "local=http://127.0.0.1:${peer}" --log-level warn
