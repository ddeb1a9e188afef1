#!/usr/bin/env bash
# The docker sandbox backend's engine and image, offline (docs/sandbox.md, "Docker backend"):
#
#   scripts/sandbox-image.sh [all|service|image]      (default: all)
#
# service: with DOCKER_HOST unset, make podman serve the Docker API on its default socket
#          (/run/podman/podman.sock as root), starting `podman system service` if nothing answers
#          there; with DOCKER_HOST set, only check that an engine answers there.
# image:   build $LEGORL_IMAGE (default legorl/debian-python:bookworm) unless the engine already holds
#          it for this recipe: a Debian root file system made from Debian packages by mmdebstrap
#          (no container registry involved), imported as an image. The root file system is cached
#          under $LEGORL_IMAGE_CACHE (default build/sandbox-image), keyed by the recipe.
#
# Settings (environment): LEGORL_IMAGE, LEGORL_IMAGE_SUITE (bookworm), LEGORL_IMAGE_PACKAGES (comma-separated,
# added to the defaults), LEGORL_IMAGE_MIRROR (default: mmdebstrap's, i.e. this host's apt sources), LEGORL_IMAGE_CACHE.
# Needs: podman (for the service), mmdebstrap (for a build), the docker CLI or podman (for the import).
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
IMAGE="${LEGORL_IMAGE:-legorl/debian-python:bookworm}"
SUITE="${LEGORL_IMAGE_SUITE:-bookworm}"
CACHE="${LEGORL_IMAGE_CACHE:-$ROOT/build/sandbox-image}"
# What the sandbox agent, the grader, the validation canaries and the built-in tasks use inside:
# python3 (the agent and pytest), pytest, git (diffs, hidden tests), bash, find/grep/xargs (essential),
# patch and procps for agents. Debian splits standard-library modules out of python3 (tkinter, dbm.gnu,
# lib2to3, distutils, ensurepip/venv): those packages too, so a task's tests see the whole standard library,
# as on the host's Python (six's moved-module tests import tkinter).
STDLIB="python3-tk,python3-gdbm,python3-lib2to3,python3-distutils,python3-venv"
PACKAGES="python3,$STDLIB,python3-pytest,python-is-python3,git,patch,procps${LEGORL_IMAGE_PACKAGES:+,$LEGORL_IMAGE_PACKAGES}"
RECIPE_VERSION=1  # bump when the build below changes
PATH_ENV="/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

log() { echo "sandbox-image: $*" >&2; }
die() { log "error: $*"; exit 1; }

if [ "$(id -u)" = 0 ]; then PODMAN_SOCK=/run/podman/podman.sock
else PODMAN_SOCK="${XDG_RUNTIME_DIR:-/run/user/$(id -u)}/podman/podman.sock"; fi
if [ -z "${DOCKER_HOST:-}" ]; then export DOCKER_HOST="unix://$PODMAN_SOCK"; OWN_SERVICE=1; else OWN_SERVICE=0; fi

engine() {  # the Docker API client: the docker CLI, else podman talking to the same socket
  if command -v docker >/dev/null; then docker "$@"
  else podman --url "$DOCKER_HOST" "$@"; fi
}

answers() { engine version --format '{{.Server.Version}}' >/dev/null 2>&1; }

service() {
  if answers; then log "engine answers at $DOCKER_HOST"; return; fi
  [ "$OWN_SERVICE" = 1 ] || die "no engine answers at DOCKER_HOST=$DOCKER_HOST"
  command -v podman >/dev/null || die "podman is not installed (apt-get install -y podman runc)"
  # The service's config and log live beside its socket, not in this checkout: the service outlives it.
  local dir; dir="$(dirname "$PODMAN_SOCK")"
  mkdir -p "$dir"
  # Our own containers.conf for this service only: runc (crun refuses hybrid cgroup v1/v2 hosts) and
  # default ulimits within this host's hard limits (podman's defaults exceed them where the driver lacks
  # CAP_SYS_RESOURCE, and the container would not start).
  local conf="$dir/legorl-containers.conf" nofile nproc ulimits=""
  nofile="$(ulimit -Hn)"; nproc="$(ulimit -Hu)"
  [ "$nofile" != unlimited ] && ulimits="\"nofile=$nofile:$nofile\""
  [ "$nproc" != unlimited ] && ulimits="$ulimits${ulimits:+, }\"nproc=$nproc:$nproc\""
  {
    echo "[containers]"
    echo "default_ulimits = [$ulimits]"
    echo "[engine]"
    echo 'events_logger = "file"'
    echo 'cgroup_manager = "cgroupfs"'
    if command -v runc >/dev/null; then echo 'runtime = "runc"'; fi
  } > "$conf"
  log "starting podman system service on $DOCKER_HOST (log: $dir/legorl-service.log)"
  # From /: a service whose working directory was removed fails every `docker run` ("getwd: ...").
  (cd / && CONTAINERS_CONF="$conf" setsid nohup podman system service --time=0 "$DOCKER_HOST" \
    > "$dir/legorl-service.log" 2>&1 < /dev/null &)
  for _ in $(seq 1 150); do answers && { log "engine answers at $DOCKER_HOST"; return; }; sleep 0.2; done
  tail -n 20 "$dir/legorl-service.log" >&2 || true
  die "podman system service did not answer at $DOCKER_HOST within 30 s"
}

image() {
  local recipe hash have rootfs t0
  recipe="v$RECIPE_VERSION suite=$SUITE packages=$PACKAGES mirror=${LEGORL_IMAGE_MIRROR:-}"
  hash="$(printf '%s' "$recipe" | sha256sum | cut -c1-16)"
  have="$(engine image inspect --format '{{index .Config.Labels "legorl.recipe"}}' "$IMAGE" 2>/dev/null || true)"
  if [ "$have" = "$hash" ]; then log "$IMAGE is up to date (recipe $hash)"; return; fi
  mkdir -p "$CACHE"
  rootfs="$CACHE/rootfs-$hash.tar"
  t0=$SECONDS
  if [ ! -s "$rootfs" ]; then
    command -v mmdebstrap >/dev/null || die "mmdebstrap is not installed (apt-get install -y mmdebstrap)"
    log "building the root file system: mmdebstrap $SUITE ($PACKAGES)"
    # Documentation, manuals and translations left out: a smaller image, a faster build.
    mmdebstrap --quiet --variant=minbase --format=tar --include="$PACKAGES" \
      --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/doc/*' \
      --dpkgopt='path-include=/usr/share/doc/*/copyright' --dpkgopt='path-exclude=/usr/share/locale/*' \
      --dpkgopt='path-exclude=/usr/share/info/*' \
      "$SUITE" "$rootfs.tmp" ${LEGORL_IMAGE_MIRROR:+"$LEGORL_IMAGE_MIRROR"}
    mv "$rootfs.tmp" "$rootfs"
    find "$CACHE" -maxdepth 1 -name 'rootfs-*.tar' ! -name "rootfs-$hash.tar" -delete
  fi
  log "importing $rootfs as $IMAGE"
  engine import --change "ENV PATH=$PATH_ENV" --change "LABEL legorl.recipe=$hash" \
    --change 'CMD ["python3"]' "$rootfs" "$IMAGE" >/dev/null
  have="$(engine image inspect --format '{{index .Config.Labels "legorl.recipe"}}' "$IMAGE" 2>/dev/null || true)"
  [ "$have" = "$hash" ] || die "the imported $IMAGE does not carry the recipe label (got '$have')"
  log "$IMAGE ready in $((SECONDS - t0)) s"
}

case "${1:-all}" in
  service) service ;;
  image) service; image ;;
  all) service; image ;;
  *) die "usage: $0 [all|service|image]" ;;
esac
