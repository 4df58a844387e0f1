#!/bin/sh
# Build both images from one base: the wheelhouse (deploy/wheelhouse.sh), then the Containerfile's
# `coordinator` and `site` targets, which share its install layers.
# Usage: deploy/build-images.sh CONTEXT BASE_IMAGE [TAG] [PYTHON]
#   -> localhost/sovfl-coordinator:TAG and localhost/sovfl-site:TAG (TAG default: latest)
# The dependencies' layer is kept as localhost/sovfl-deps:DEPS_ID (the digest of their wheels), so
# removing the images leaves it as a cache: the next build with the same pins installs only the
# project. Older sovfl-deps tags are removed once no image is built on them.
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
DEPS=$(cat "$CONTEXT/deps.sha256")
ID=$(cat "$CONTEXT/wheels.sha256")
for target in deps coordinator site; do
    tag=$TAG
    [ "$target" = deps ] && tag=$DEPS
    # shellcheck disable=SC2086 - BUILDAH_EXTRA is a list of options
    buildah bud -q --format docker --layers ${BUILDAH_EXTRA:-} --build-arg BASE_IMAGE="$BASE" \
        --build-arg DEPS_ID="$DEPS" --build-arg WHEELHOUSE_ID="$ID" -f "$HERE/Containerfile" \
        --target "$target" -t "localhost/sovfl-$target:$tag" "$CONTEXT" >/dev/null
    [ "$target" = deps ] || echo "localhost/sovfl-$target:$TAG"
done
# without --force, buildah keeps an image that others are built on: only unused old caches go
for old in $(buildah images --noheading --format '{{.Name}}:{{.Tag}}' | grep '^localhost/sovfl-deps:'); do
    [ "$old" = "localhost/sovfl-deps:$DEPS" ] || buildah rmi "$old" >/dev/null 2>&1 || true
done
