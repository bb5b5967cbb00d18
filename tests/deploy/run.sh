#!/usr/bin/env bash
# make test-deploy: the local base image (once), the images (cached layers), then the container
# tests. Where podman cannot run containers it prints why and exits 0.
# Build settings come from the environment (deploy/images/build.sh): BASE, PIP_ARGS,
# TORCH_PIP_ARGS, TORCH_REQUIREMENTS, BUILD_VOLUMES.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY="${PY:-.venv/bin/python}"
export CONTAINERS_CONF="${CONTAINERS_CONF:-$PWD/deploy/podman/containers.conf}"
skip() { printf '\n*** make test-deploy SKIPPED: %s ***\n\n' "$*"; exit 0; }
start=$SECONDS
command -v podman >/dev/null || skip "podman is not installed (apt-get install podman buildah runc debootstrap podman-compose)"
command -v podman-compose >/dev/null || skip "podman-compose is not installed (apt-get install podman-compose)"
export BASE="${BASE:-localhost/debian:bookworm}"
if [ "$BASE" = localhost/debian:bookworm ]; then
    command -v debootstrap >/dev/null || skip "debootstrap is not installed: no local base image"
    deploy/images/base.sh "$BASE" || skip "could not create the base image with debootstrap (see above)"
fi
probe="$(podman run --rm --network none "$BASE" true 2>&1)" || skip "podman cannot run containers here: ${probe##*$'\n'}"
deploy/images/build.sh aggregator dashboard client postgres
echo "images ready after $((SECONDS - start)) s"
FEDATOMS_DEPLOY_TESTS=1 "$PY" -m pytest tests/deploy -p no:xdist -p no:randomly -v -s "$@"
echo "make test-deploy: $((SECONDS - start)) s in all"
