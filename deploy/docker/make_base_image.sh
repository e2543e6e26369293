#!/usr/bin/env bash
# Makes a Debian 12 base image from a Debian mirror, for machines that reach no registry (the
# Dockerfile's BASE_IMAGE): debootstrap's minimal system, imported as an image. Needs root,
# debootstrap and a running Docker engine; does nothing when the image exists.
#
#   deploy/docker/make_base_image.sh [NAME:TAG]       (default dbs-base:bookworm)
#
# DEBIAN_MIRROR picks the mirror (default: the first one this machine's apt uses).
set -euo pipefail
name=${1:-dbs-base:bookworm}
if docker image inspect "$name" >/dev/null 2>&1; then
  echo "make_base_image: $name exists"
  exit 0
fi
mirror=${DEBIAN_MIRROR:-$( (grep -hoE '^(URIs:|deb) +https?://[^ ]+/debian/?( |$)' \
  /etc/apt/sources.list /etc/apt/sources.list.d/*.sources /etc/apt/sources.list.d/*.list \
  2>/dev/null || true) | head -1 | awk '{print $2}')}
mirror=${mirror:-http://deb.debian.org/debian}
root=$(mktemp -d)
trap 'rm -rf "$root"' EXIT
start=$(date +%s)
echo "make_base_image: debootstrap bookworm from $mirror"
debootstrap --variant=minbase bookworm "$root" "$mirror" >"$root.log" 2>&1 ||
  { tail -20 "$root.log" >&2; rm -f "$root.log"; exit 1; }
rm -f "$root.log"
# The security and point-release updates, as on any Debian 12 system.
cat >"$root/etc/apt/sources.list" <<LIST
deb $mirror bookworm main
deb $mirror bookworm-updates main
deb ${mirror%/debian*}/debian-security bookworm-security main
LIST
rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/archives/*.deb
tar -C "$root" -c . | docker import - "$name" >/dev/null
echo "make_base_image: $name ($(docker image inspect -f '{{.Size}}' "$name" | numfmt --to=iec)) in $(( $(date +%s) - start )) s"
