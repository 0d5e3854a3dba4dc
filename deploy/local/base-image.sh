#!/bin/sh
# A Python base image made on this machine, for building the Dockerfiles
# where no registry serves python:3.x-slim or nvidia/cuda (build arguments
# PYTHON_IMAGE and CUDA_IMAGE): Debian stable (minbase) with Debian's Python 3.
#
#   deploy/local/base-image.sh [IMAGE] [CACHE_DIR]
#
# Needs root, debootstrap and podman. The root filesystem's tarball is kept
# in CACHE_DIR, so a later run imports it again without downloading.
set -eu
IMAGE=${1:-localhost/infergate-base:bookworm}
CACHE=${2:-${XDG_CACHE_HOME:-$HOME/.cache}/infergate}
SUITE=${DEBIAN_SUITE:-bookworm}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
TARBALL="$CACHE/debian-$SUITE-python3.tar"

if podman image exists "$IMAGE"; then
    exit 0
fi
if [ ! -s "$TARBALL" ]; then
    mkdir -p "$CACHE"
    ROOTFS=$(mktemp -d "$CACHE/rootfs.XXXXXX")
    trap 'rm -rf "$ROOTFS"' EXIT
    # python-is-python3: the slim images' `python` command, which the Dockerfiles call.
    debootstrap --variant=minbase --include=python3,python3-venv,python-is-python3,ca-certificates \
        "$SUITE" "$ROOTFS" "$MIRROR"
    chroot "$ROOTFS" apt-get clean
    rm -rf "$ROOTFS"/var/lib/apt/lists/* "$ROOTFS"/var/cache/apt/*.bin
    tar --numeric-owner -C "$ROOTFS" -cf "$TARBALL.part" .
    mv "$TARBALL.part" "$TARBALL"
fi
podman import --quiet --change 'CMD ["python3"]' "$TARBALL" "$IMAGE" >/dev/null
echo "base image $IMAGE from $TARBALL"
