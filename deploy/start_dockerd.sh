#!/usr/bin/env bash
# Starts a Docker engine for the container tests (tests/compose_test.py) when none answers:
# dockerd in the background, its log in /var/log/dbs-dockerd.log (machines without systemd, CI).
# Needs root; says why and exits 0 when it cannot, and the container tests then skip, saying so.
set -uo pipefail
if docker info >/dev/null 2>&1; then
  echo "start_dockerd: a Docker engine answers"
  exit 0
fi
if [ "$(id -u)" -ne 0 ]; then
  echo "start_dockerd: no Docker engine answers, and starting one needs root"
  exit 0
fi
if ! command -v dockerd >/dev/null 2>&1; then
  echo "start_dockerd: dockerd is not installed (deploy/install_deps.sh installs docker.io)"
  exit 0
fi
nohup dockerd >/var/log/dbs-dockerd.log 2>&1 &
for _ in $(seq 60); do
  if docker info >/dev/null 2>&1; then
    echo "start_dockerd: dockerd started ($(docker info -f '{{.ServerVersion}}, {{.Driver}}, cgroup {{.CgroupVersion}}'))"
    exit 0
  fi
  sleep 1
done
echo "start_dockerd: dockerd did not answer within 60 s; its log:"
tail -20 /var/log/dbs-dockerd.log
exit 0
