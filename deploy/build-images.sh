#!/bin/sh
# Build both images from one base: the wheelhouse (deploy/wheelhouse.sh), then the Containerfile's
# `coordinator` and `site` targets, which share its install layer.
# Usage: deploy/build-images.sh CONTEXT BASE_IMAGE [TAG] [PYTHON]
#   -> localhost/sovfl-coordinator:TAG and localhost/sovfl-site:TAG (TAG default: latest)
# BUILDAH_EXTRA: more `buildah bud` options (e.g. "--runtime runc --ulimit nofile=20000:20000").
set -eu
CONTEXT=${1:?usage: deploy/build-images.sh CONTEXT BASE_IMAGE [TAG] [PYTHON]}
BASE=${2:?usage: deploy/build-images.sh CONTEXT BASE_IMAGE [TAG] [PYTHON]}
TAG=${3:-latest}
PY=${4:-python3}
HERE=$(cd "$(dirname "$0")" && pwd)
. "$HERE/preflight.sh"
need buildah buildah "building the images"
need runc runc "the build containers' runtime"
need_podman_network
preflight_done
"$HERE/wheelhouse.sh" "$CONTEXT" "$PY"
ID=$(cat "$CONTEXT/wheels.sha256")
for target in coordinator site; do
    # shellcheck disable=SC2086 - BUILDAH_EXTRA is a list of options
    buildah bud -q --format docker --layers ${BUILDAH_EXTRA:-} --build-arg BASE_IMAGE="$BASE" \
        --build-arg WHEELHOUSE_ID="$ID" -f "$HERE/Containerfile" --target "$target" \
        -t "localhost/sovfl-$target:$TAG" "$CONTEXT" >/dev/null
    echo "localhost/sovfl-$target:$TAG"
done
