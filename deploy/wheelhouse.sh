#!/bin/sh
# The images' build context: CONTEXT/app holds the project's wheel, CONTEXT/wheels every dependency
# it pins, as wheels, resolved by this host's pip (its configuration, indexes and find-links apply:
# where a CPU torch wheel is what this host installs, that is what lands here and in the image).
# Two digests, one per directory, key the Containerfile's two install layers: a change to the
# project's code rebuilds only its own small layer, never the dependencies' (torch and the rest).
# Usage: deploy/wheelhouse.sh CONTEXT [PYTHON]   (PYTHON: an interpreter with pip and setuptools,
# the same minor version as the image's python3; default python3)
set -eu
CONTEXT=${1:?usage: deploy/wheelhouse.sh CONTEXT [PYTHON]}
PY=${2:-python3}
SRC=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$CONTEXT/wheels" "$CONTEXT/app"
WHEELS=$(cd "$CONTEXT/wheels" && pwd)
APP=$(cd "$CONTEXT/app" && pwd)
COPY=$(mktemp -d)
trap 'rm -rf "$COPY"' EXIT
# the wheel is built from a copy: building in the source tree would leave build/ there
tar -C "$SRC" --exclude=__pycache__ -c pyproject.toml README.md crypto federation site_trainer tracking | tar -C "$COPY" -x
rm -f "$APP"/sovereign_fl-*.whl "$WHEELS"/sovereign_fl-*.whl
"$PY" -m pip wheel -q --disable-pip-version-check --no-deps --no-build-isolation -w "$APP" "$COPY"
"$PY" -m pip download -q --disable-pip-version-check --only-binary=:all: -d "$WHEELS" "$APP"/sovereign_fl-*.whl
rm -f "$WHEELS"/sovereign_fl-*.whl  # pip download copies the requested wheel too
# the digests the Containerfile takes as DEPS_ID and WHEELHOUSE_ID (layer caches stay keyed on the wheels)
(cd "$WHEELS" && sha256sum -- *.whl) | sha256sum | cut -c1-16 > "$CONTEXT/deps.sha256"
cat "$CONTEXT/deps.sha256" "$APP"/sovereign_fl-*.whl | sha256sum | cut -c1-16 > "$CONTEXT/wheels.sha256"
echo "wheelhouse $(cat "$CONTEXT/wheels.sha256") (dependencies $(cat "$CONTEXT/deps.sha256")): $(ls "$WHEELS" | wc -l) wheels and the project's, $(ls "$WHEELS" | grep '^torch-')"
