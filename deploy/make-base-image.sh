#!/bin/sh
# A local Debian bookworm base image (no registry needed): debootstrap --variant=minbase, then
# `podman import`. Usage: deploy/make-base-image.sh [IMAGE] [MIRROR]
# (default IMAGE localhost/sovfl-base:bookworm). Needs root, debootstrap and podman.
set -eu
. "$(cd "$(dirname "$0")" && pwd)/preflight.sh"
need debootstrap debootstrap "the Debian root file system"
need podman podman "importing it as an image"
preflight_done
IMAGE=${1:-localhost/sovfl-base:bookworm}
MIRROR=${2:-http://deb.debian.org/debian}
ROOTFS=$(mktemp -d /var/tmp/sovfl-base.XXXXXX)
trap 'rm -rf "$ROOTFS"' EXIT
# python3 (3.11 on bookworm, matching the cp311 wheels) and CA certificates; nothing else
debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates,procps bookworm "$ROOTFS" "$MIRROR" >/dev/null
rm -rf "$ROOTFS"/var/cache/apt/archives/*.deb "$ROOTFS"/var/lib/apt/lists/*
tar -C "$ROOTFS" -c . | podman import --change 'CMD ["/bin/bash"]' - "$IMAGE" >/dev/null
echo "$IMAGE"
