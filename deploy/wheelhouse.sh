#!/bin/sh
# The images' build context: CONTEXT/wheels holds the project's wheel and every dependency it pins,
# as wheels, resolved by this host's pip (its configuration, indexes and find-links apply: where a
# CPU torch wheel is what this host installs, that is what lands here and in the image).
# Usage: deploy/wheelhouse.sh CONTEXT [PYTHON]   (PYTHON: an interpreter with pip and setuptools,
# the same minor version as the image's python3; default python3)
set -eu
CONTEXT=${1:?usage: deploy/wheelhouse.sh CONTEXT [PYTHON]}
PY=${2:-python3}
SRC=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$CONTEXT/wheels"
WHEELS=$(cd "$CONTEXT/wheels" && pwd)
COPY=$(mktemp -d)
trap 'rm -rf "$COPY"' EXIT
# the wheel is built from a copy: building in the source tree would leave build/ there
tar -C "$SRC" --exclude=__pycache__ -c pyproject.toml README.md crypto federation site_trainer tracking | tar -C "$COPY" -x
rm -f "$WHEELS"/sovereign_fl-*.whl
"$PY" -m pip wheel -q --disable-pip-version-check --no-deps --no-build-isolation -w "$WHEELS" "$COPY"
"$PY" -m pip download -q --disable-pip-version-check --only-binary=:all: -d "$WHEELS" "$WHEELS"/sovereign_fl-*.whl
# the digest the Containerfile takes as WHEELHOUSE_ID (layer caches stay keyed on the wheels)
(cd "$WHEELS" && sha256sum -- *.whl) | sha256sum | cut -c1-16 > "$CONTEXT/wheels.sha256"
echo "wheelhouse $(cat "$CONTEXT/wheels.sha256"): $(ls "$WHEELS" | wc -l) wheels, $(ls "$WHEELS" | grep '^torch-')"
