#!/usr/bin/env bash
# Builds the three images from the repository root and prints their sizes.
#   deploy/images/build.sh [aggregator] [dashboard] [client] [postgres]   (default: the first three)
# postgres: PostgreSQL 15 from Debian, for hosts that cannot pull docker.io/library/postgres.
# Environment (all optional):
#   BASE=docker.io/library/python:3.11-slim-bookworm   the base image (any Debian bookworm)
#   TAG=latest  PREFIX=localhost/fedatoms-             image names: ${PREFIX}aggregator:${TAG} …
#   PIP_ARGS="--cert /build-ca.crt …"                  pip options for every install
#   TORCH_PIP_ARGS="--index-url https://download.pytorch.org/whl/cpu"   where torch comes from
#   TORCH_REQUIREMENTS=""                              replaces pyproject.toml's torch pins
#   BUILD_VOLUMES="/opt/pypi:/opt/pypi:ro …"           bind mounts for the RUN steps (local indexes, CA)
#   ENGINE=podman                                      or docker (BUILD_VOLUMES need podman/buildah)
set -euo pipefail
cd "$(dirname "$0")/../.."
engine="${ENGINE:-podman}"
prefix="${PREFIX:-localhost/fedatoms-}"
tag="${TAG:-latest}"
images=("$@")
[ ${#images[@]} -gt 0 ] || images=(aggregator dashboard client)
# docker format: the OCI image format has no HEALTHCHECK, and podman would drop it
args=(--format docker --ignorefile deploy/images/containerignore)
[ -z "${BASE:-}" ] || args+=(--build-arg "BASE=$BASE")
[ -z "${PIP_ARGS:-}" ] || args+=(--build-arg "PIP_ARGS=$PIP_ARGS")
[ -z "${TORCH_PIP_ARGS:-}" ] || args+=(--build-arg "TORCH_PIP_ARGS=$TORCH_PIP_ARGS")
[ -z "${TORCH_REQUIREMENTS:-}" ] || args+=(--build-arg "TORCH_REQUIREMENTS=$TORCH_REQUIREMENTS")
for volume in ${BUILD_VOLUMES:-}; do args+=(--volume "$volume"); done
for image in "${images[@]}"; do
    start=$SECONDS
    file="deploy/images/Containerfile.$image"
    [ "$image" != postgres ] || file=deploy/images/postgres/Containerfile
    "$engine" build "${args[@]}" -f "$file" -t "$prefix$image:$tag" . \
        > "${BUILD_LOG_DIR:-/tmp}/fedatoms-build-$image.log" 2>&1 \
        || { tail -30 "${BUILD_LOG_DIR:-/tmp}/fedatoms-build-$image.log" >&2; exit 1; }
    echo "built $prefix$image:$tag in $((SECONDS - start)) s"
done
echo "image sizes:"
for image in "${images[@]}"; do
    size=$("$engine" image inspect --format '{{.Size}}' "$prefix$image:$tag")
    printf '  %-40s %6d MB\n' "$prefix$image:$tag" $((size / 1000000))
done
