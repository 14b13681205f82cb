#!/usr/bin/env bash
# Prepare, on a machine with PyPI, what benchmarks/gpu/pd_two_gpu.sh needs on the GPU image that
# the image lacks (no network there; see the device README, "Notes", and KINDS.md):
#   $CARRY/wheels/   wheels for the image's Python (3.12, x86-64): the router's web stack
#                    (fastapi, starlette, uvicorn, pydantic), redis-py + hiredis,
#                    grpcio-health-checking, xxhash (KV record checksums), and grpcio /
#                    protobuf / prometheus_client at the
#                    versions the committed stubs and our pins expect (the image's own
#                    versions are not recorded, so these override them on PYTHONPATH)
#   $CARRY/redis/    Debian's redis-server with the shared libraries it links (bin/redis-server
#                    is a wrapper that points LD_LIBRARY_PATH at lib/ for redis alone)
# CARRY defaults to out/pd_two_gpu_carry, git-ignored through /out/; name it in the device
# call's `carry` (about 25 MB; the working tree that travels must stay under 64 MiB).
set -euo pipefail

REPO=$(cd "$(dirname "$0")/../.." && pwd)
CARRY=${CARRY:-$REPO/out/pd_two_gpu_carry}
PY=${PY:-$REPO/.venv/bin/python}
PYTHON_VERSION=${PYTHON_VERSION:-3.12}  # KINDS.md: python3 there is 3.12.3

# One version of each (two of one package stop the whole install there). Pins follow the
# project's CPU environment, which the tests run against.
PACKAGES=(
  fastapi==0.141.1 starlette==1.10.0 annotated-doc==0.0.7
  pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
  typing-extensions==4.16.0 anyio==4.16.0
  uvicorn==0.54.0
  redis==8.1.0 hiredis==3.5.0
  grpcio==1.78.0 grpcio-health-checking==1.78.0 protobuf==6.33.6
  prometheus-client==0.24.1
  xxhash==3.6.0
  py-spy==0.4.1  # serving-path profiles during online runs (online_round.sh PD_PROFILE)
)
PLATFORMS=()
for tag in manylinux_2_28 manylinux_2_27 manylinux_2_17 manylinux2014 manylinux1 manylinux_2_24 \
  manylinux_2_31 manylinux_2_34 manylinux_2_35; do
  PLATFORMS+=(--platform "${tag}_x86_64")
done

rm -rf "$CARRY"
mkdir -p "$CARRY/wheels" "$CARRY/redis/bin" "$CARRY/redis/libexec" "$CARRY/redis/lib"
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$PYTHON_VERSION" \
  --implementation cp "${PLATFORMS[@]}" -d "$CARRY/wheels" "${PACKAGES[@]}"
count=$(find "$CARRY/wheels" -name "*.whl" | wc -l)
if [ "$count" -ne "${#PACKAGES[@]}" ]; then
  echo "expected ${#PACKAGES[@]} wheels, got $count" >&2
  exit 1
fi

# redis-server: the Debian binary (redis-server is a link to redis-check-rdb, which acts as
# the server unless its name says check-rdb/check-aof) and every library it links but glibc.
binary=$(readlink -f "$(command -v redis-server)")
cp "$binary" "$CARRY/redis/libexec/redis-server"
ldd "$binary" | awk '/=> \// {print $3}' | while read -r lib; do
  case "$(basename "$lib")" in
    libc.so.* | libm.so.* | ld-linux-*) ;;  # glibc: the image's newer one runs older builds
    *) cp -L "$lib" "$CARRY/redis/lib/" ;;
  esac
done
cat >"$CARRY/redis/bin/redis-server" <<'EOF'
#!/bin/sh
# Debian's redis-server with its own libraries (carried by benchmarks/gpu/pd_two_gpu_wheels.sh).
here=$(cd "$(dirname "$0")/.." && pwd)
LD_LIBRARY_PATH="$here/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" exec "$here/libexec/redis-server" "$@"
EOF
chmod +x "$CARRY/redis/bin/redis-server"
env -i "$CARRY/redis/bin/redis-server" --version

du -sh "$CARRY"
ls "$CARRY/wheels"
echo "ready: carry $(realpath --relative-to="$REPO" "$CARRY") in the device call"
