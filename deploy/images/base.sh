#!/usr/bin/env bash
# Creates the local base image localhost/debian:bookworm once (debootstrap minbase + podman
# import), for hosts that cannot reach a container registry. Cached: a second run does nothing.
#   deploy/images/base.sh [IMAGE]     (MIRROR=... to choose the Debian mirror)
set -euo pipefail
image="${1:-localhost/debian:bookworm}"
if podman image exists "$image"; then
    echo "base image $image: cached"
    exit 0
fi
mirror="${MIRROR:-$(sed -n 's/^URIs: *\([^ ]*\).*/\1/p' /etc/apt/sources.list.d/debian.sources 2>/dev/null | head -1)}"
mirror="${mirror:-http://deb.debian.org/debian}"
rootfs="$(mktemp -d /var/tmp/fedatoms-base.XXXXXX)"
trap 'rm -rf "$rootfs"' EXIT
echo "base image $image: debootstrap --variant=minbase bookworm from $mirror"
debootstrap --variant=minbase bookworm "$rootfs" "$mirror" >/dev/null
# the image needs no apt lists or docs; the builds run apt-get update themselves
rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/*.bin "$rootfs"/usr/share/doc/* "$rootfs"/usr/share/man/*
tar -C "$rootfs" -c . | podman import --change 'CMD ["/bin/bash"]' \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' - "$image" >/dev/null
echo "base image $image: created ($(podman image inspect --format '{{.Size}}' "$image") bytes)"
