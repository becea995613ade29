#!/usr/bin/env bash
# A built ember carried from one call on the GPU machine to the next. That machine starts bare after 30 s
# idle, and each build there takes about 2 of a session's 30 minutes; a later call whose C++ sources are
# unchanged can install the earlier build instead.
#   bash .ci/prebuilt.sh pack FILE     after .ci/install.sh: the installed package, the C++ tests, libember.so
#                                      and the hash of what they were built from, into FILE (a .tgz)
#   bash .ci/prebuilt.sh unpack FILE   installs FILE where this tree and torch still hash the same, with this
#                                      tree's Python files (editing those needs no build); else exits 1 (build)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

# Every file the build reads (the Python tests, benchmarks, docs and GPU check scripts are not), and the torch it built against.
sources_hash() {
  {
    git ls-files -z --cached --others --exclude-standard -- . ':(exclude)test/python' ':(exclude)test/fuzz/*.py' \
      ':(exclude)test/fuzz/repros' ':(exclude)bench' ':(exclude)docs' ':(exclude)examples' ':(exclude)*.md' \
      ':(exclude)python_bindings/ember/*.py' ':(exclude).ci/gpu_*.sh' | sort -z | xargs -0 sha256sum
    "$PY" -c "import torch; print(torch.__version__, torch.version.cuda)"
  } | sha256sum | cut -d' ' -f1
}

site_packages() { "$PY" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])"; }

case "${1:-}" in
  pack)
    site=$(site_packages)
    dist=$(cd "$site" && ls -d ember-*.dist-info)
    tmp=$(mktemp -d)
    sources_hash > "$tmp/SOURCES"
    tar czf "$2" -C "$site" ember "$dist" -C "$PWD" build/py/libember.so build/py/test/cpp/ember_tests -C "$tmp" SOURCES
    echo "prebuilt: packed $(du -h "$2" | cut -f1) into $2"
    ;;
  unpack)
    [ -f "${2:-}" ] || { echo "prebuilt: no ${2:-file}"; exit 1; }
    tmp=$(mktemp -d)
    tar xzf "$2" -C "$tmp"
    if [ "$(cat "$tmp/SOURCES")" != "$(sources_hash)" ]; then
      echo "prebuilt: $2 was built from other sources (or another torch)"
      exit 1
    fi
    site=$(site_packages)
    rm -rf "$site"/ember "$site"/ember-*.dist-info
    cp -r "$tmp"/ember "$tmp"/ember-*.dist-info "$site"/
    cp python_bindings/ember/*.py "$site"/ember/
    mkdir -p build/py/test/cpp
    rm -f build/py/libember.so build/py/test/cpp/ember_tests  # new files: a running process keeps the old ones
    cp "$tmp"/build/py/libember.so build/py/
    cp "$tmp"/build/py/test/cpp/ember_tests build/py/test/cpp/
    echo "prebuilt: installed $2"
    ;;
  *)
    echo "usage: bash .ci/prebuilt.sh pack|unpack FILE" >&2
    exit 2
    ;;
esac
