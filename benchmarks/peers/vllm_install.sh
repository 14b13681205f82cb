#!/usr/bin/env bash
# The GPU machine's side of vllm_carry.sh (run from the repository root there):
#   bash benchmarks/peers/vllm_install.sh stash .carry/vllm/pK   # once per carried part
#   bash benchmarks/peers/vllm_install.sh unpack                 # after the last part
# The parts wait in $STASH (/tmp survives between calls while the machine stays warm); unpack
# joins them, checks the sha256 that vllm_carry.sh wrote, and extracts the site-packages tree
# into $SITE. Then: PYTHONPATH=$SITE:. python3 -m benchmarks.peers.offline --engine vllm ...
set -euo pipefail
STASH=${STASH:-/tmp/vllm-carry}
SITE=${SITE:-/tmp/vllm-site}

case "${1:-}" in
  stash)
    mkdir -p "$STASH"
    cp "${2:?stash needs the carried folder}"/* "$STASH/"
    ls -la "$STASH"
    ;;
  unpack)
    cd "$STASH"
    cat vllm-site.tar.gz.part* >vllm-site.tar.gz
    sha256sum -c vllm-site.sha256
    rm -f vllm-site.tar.gz.part*
    mkdir -p "$SITE"
    tar -C "$SITE" -xzf vllm-site.tar.gz
    rm vllm-site.tar.gz
    PYTHONPATH=$SITE python3 -c 'import vllm, flashinfer; print("vllm", vllm.__version__, "flashinfer", flashinfer.__version__)'
    ;;
  *)
    echo "usage: $0 stash DIR | unpack" >&2
    exit 2
    ;;
esac
