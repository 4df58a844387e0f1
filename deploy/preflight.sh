#!/bin/sh
# Sourced by the image scripts: each tool they (or podman underneath) call, with the Debian package
# that provides it, so a bare machine fails at once with what to install instead of deep in a build.
# need TOOL PACKAGE WHAT_FOR: TOOL is a command on PATH or an absolute path.
MISSING=""
need() {
    case "$1" in
        /*) [ -e "$1" ] && return 0 ;;
        *) command -v "$1" >/dev/null 2>&1 && return 0 ;;
    esac
    echo "missing: $1 (Debian package: $2), needed for $3" >&2
    MISSING="$MISSING $2"
}
# podman's network backend: netavark sets up every container network, a build's RUN steps included,
# and bookworm's netavark calls iptables to do it (nft for the nftables driver of later netavarks).
need_podman_network() {
    [ -e /usr/lib/podman/netavark ] || [ -e /usr/libexec/podman/netavark ] || {
        echo "missing: netavark (Debian package: netavark), podman's network backend" >&2
        MISSING="$MISSING netavark"
    }
    command -v iptables >/dev/null 2>&1 || command -v nft >/dev/null 2>&1 || {
        echo "missing: iptables (Debian package: iptables), which netavark calls to set up container networks" >&2
        MISSING="$MISSING iptables"
    }
}
preflight_done() {
    [ -z "$MISSING" ] && return 0
    echo "install them first: apt-get install$MISSING" >&2
    exit 127
}
