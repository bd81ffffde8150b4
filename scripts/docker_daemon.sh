#!/usr/bin/env bash
# Start or stop a Docker daemon for the compose test (tests/integration/test_compose.py), on a
# Debian machine where none runs (CI: .ci/run). Needs root.
#
#   scripts/docker_daemon.sh start   install what is missing (Debian's docker.io and
#                                    debootstrap; Compose v2 via docker/install_compose.sh),
#                                    start dockerd unless one answers, wait for it
#   scripts/docker_daemon.sh stop    stop the dockerd that `start` started, and take back
#                                    what it did to this machine's network: its iptables
#                                    chains and rules, the FORWARD policy, the docker0 bridge
#
# Images stay in /var/lib/docker (a later start finds the base images built before).
# `start` exits non-zero with the reason where it cannot (not root, no apt, dockerd fails):
# the compose test then skips, saying no daemon answers.
set -euo pipefail
cd "$(dirname "$0")/.."
STATE=${XLLM_DOCKERD_STATE:-/tmp/xllm-dockerd}
mkdir -p "$STATE"

say() { echo "docker_daemon: $*"; }
answers() { timeout 20 docker info >/dev/null 2>&1; }

start() {
  if command -v docker >/dev/null && answers; then
    say "a Docker daemon answers already"
  else
    [ "$(id -u)" = 0 ] || { say "not root: cannot start dockerd"; exit 1; }
    if ! command -v dockerd >/dev/null || ! command -v debootstrap >/dev/null; then
      say "installing docker.io and debootstrap (apt-get)"
      (apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q docker.io debootstrap) \
        >"$STATE/apt.log" 2>&1 || { tail -5 "$STATE/apt.log"; say "apt-get failed"; exit 1; }
    fi
    # what dockerd changes, to take back at stop: was there a FORWARD DROP policy or a docker0?
    iptables -S FORWARD 2>/dev/null | head -1 >"$STATE/forward-policy" || true
    ip link show docker0 >/dev/null 2>&1 && touch "$STATE/had-docker0" || rm -f "$STATE/had-docker0"
    nohup dockerd >"$STATE/dockerd.log" 2>&1 &
    echo $! >"$STATE/pid"
    for _ in $(seq 60); do answers && break; sleep 1; done
    answers || { tail -20 "$STATE/dockerd.log"; say "dockerd did not answer in 60 s"; exit 1; }
    say "dockerd started (pid $(cat "$STATE/pid"), log $STATE/dockerd.log)"
  fi
  bash docker/install_compose.sh
}

stop() {
  [ -f "$STATE/pid" ] || { say "no dockerd started by this script"; return 0; }
  pid=$(cat "$STATE/pid")
  if [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = dockerd ]; then  # (not a reused pid)
    kill -TERM "$pid"
    for _ in $(seq 60); do kill -0 "$pid" 2>/dev/null || break; sleep 1; done
  fi
  rm -f "$STATE/pid"
  # dockerd leaves its chains, its rules and the FORWARD policy behind when it exits
  if command -v iptables-save >/dev/null; then  # each table restored without Docker's lines
    for table in filter nat; do
      iptables-save -t "$table" | grep -v -e DOCKER -e docker0 | iptables-restore -T "$table"
    done
    grep -q -- "-P FORWARD DROP" "$STATE/forward-policy" 2>/dev/null || iptables -P FORWARD ACCEPT
  fi
  [ -f "$STATE/had-docker0" ] || ip link del docker0 2>/dev/null || true
  say "dockerd stopped; its iptables rules and docker0 removed"
}

case "${1:-}" in
  start) start ;;
  stop) stop ;;
  *) echo "usage: $0 start|stop" >&2; exit 2 ;;
esac
